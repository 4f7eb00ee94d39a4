"""Clients of the engines a rollout worker drives: SGLang and vLLM servers over HTTP (one shared base), and
transformers in process."""
