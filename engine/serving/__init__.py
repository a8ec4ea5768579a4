"""The OpenAI-compatible server on rank 0: the engine thread, the app and its endpoints, the protocol, hosting."""
