"""cvllm's GPTQ and AWQ quantizers. Kept light: cvllm imports this package at every start (``plugin.py``)."""
