"""What users hold: the offline `LLM` API, the OpenAI-compatible server, batch jobs, perplexity."""
