"""Framework-free speculator core (torch only; never imports vllm, sglang, transformers or
``dyntree.kernels``): :class:`~dyntree.common.speculator.Speculator` is the one object every engine
calls per step; the drafters live in :mod:`dyntree.common.drafters`."""
