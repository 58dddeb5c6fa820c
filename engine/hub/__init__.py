"""Models by Hugging Face name: `owner/repo:QUANT` (a GGUF quantization) and `owner/repo` (the default GGUF, or a
safetensors checkpoint), pulled into and found in the Hugging Face cache through huggingface_hub.

`names` reads names and picks a repo's files (pure); `cache` finds, lists and removes pulled models without the
network; `pull` downloads and verifies them.
"""
