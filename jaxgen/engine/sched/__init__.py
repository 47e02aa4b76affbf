"""Host-side scheduling: sequences, the scheduler (chunked prefill, preemption, prefix cache
through the block manager) and beam search. Plain Python and numpy: no JAX, no tokenizer."""
