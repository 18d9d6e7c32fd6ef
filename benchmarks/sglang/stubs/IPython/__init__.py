"""Import-time stand-in for IPython in the SGLang interop processes only (sglang.utils imports
IPython.display at module level; the real package is not needed to drive SGLang's KV transfer classes)."""
