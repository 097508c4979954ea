"""Decoders: the engines :func:`openaligner.models.generation.generate` steps, one module each.

A decoder runs a causal LM over the sampling loop's left-padded token buffer and owns the KV cache
(the :class:`~openaligner.models.decoders.base.Decoder` protocol); :mod:`openaligner.models.fast_paths`
picks one per model. A new engine (GPU kernels, a sharded model) is a new module here plus one rule
there. Decoders know model architectures and return logits; they know nothing of sampling.
"""
