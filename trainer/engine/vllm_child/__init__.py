"""The program a vLLM generator replica runs (`vllm_replica.py`), in vLLM's own environment.

Its folder holds nothing else but `sitecustomize.py` (the AMX permission, in every process the
child starts): it is the child's import path (a module of the worker beside it, `resource.py`
say, would shadow the standard library's of the same name)."""
