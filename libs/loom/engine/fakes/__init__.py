"""Simulated SGLang and vLLM servers (one shared server loop): the real clients are tested against them, and
``loom simserver`` serves them. As strict as the real servers on what they refuse."""
