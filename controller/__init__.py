"""rota's lease controller (one awake engine per GPU) and its OpenAI-compatible gateway."""
