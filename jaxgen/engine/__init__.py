"""The core loop, no I/O formats: request parameters and outputs, the scheduler (``sched``), the
model runner with the one step packer and the jitted steps (``runner``), sampling (``sample``)
and speculative decoding (``spec_decode``); ``core`` drives them step by step."""
