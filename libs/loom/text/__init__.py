"""Text: the Qwen tokenizer, the chat template, and the OpenAI-compatible wire types."""
