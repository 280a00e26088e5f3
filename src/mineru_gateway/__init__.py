"""mineru-gateway: an OpenAI-compatible gateway for MinerU2.5 over vLLM workers."""

__version__ = "0.1.0"
