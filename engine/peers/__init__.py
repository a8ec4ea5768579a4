"""Other engines' names for a plan: export a plan to vLLM, SGLang or TensorRT-LLM, import their settings back,
check an export against an installed vLLM, and serve a plan with vLLM for `dcpctl eval` / `dcpctl bench`."""
