"""``--speculative-algorithm DYNTREE``: SGLang's flags and the options file -> one validated config.

A plugin cannot add flags to SGLang, so DYNTREE reuses SGLang's own (docs/sglang.md):

========================================== ==================================================
``--speculative-num-draft-tokens N``       verify slots per request, root included: the node
                                           budget is ``N - 1`` draft nodes
``--speculative-num-steps D``              deepest draft node
``--speculative-eagle-topk K``             most children of one node (dynamic trees)
``--speculative-draft-model-path DIR``     Hydra heads directory (drafter ``hydra:DIR``)
``--speculative-draft-model-quantization`` the quantized self-draft: an int4 weight-only
                                           method (``awq``, ``gptq``, ...) -> ``qspec:w4a16,g64``
========================================== ==================================================

Everything else (drafter, tree mode, tree and controller options) is a JSON object of
:class:`~dyntree.common.config.SpecConfig` fields in the file named by ``DYNTREE_SGLANG_CONFIG``,
validated by the same parser as the vLLM adapter's options. :func:`resolve_server_args` fills the
flags SGLang leaves unset for a plugin algorithm, then refuses (naming the flag) every setting
tree verification would get wrong. Nothing here imports SGLang: the functions take any object
with ``ServerArgs``' attribute names. Per request, :func:`request_sampling` maps SGLang's sampling
parameters onto the core's and :func:`unsupported_request` names what tree verification cannot
apply.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dyntree.common.config import SamplingParams, SpecConfig
from dyntree.common.engine_options import OptionsError, parse_spec_options

__all__ = ["ENV", "NAME", "OptionsError", "load_options", "resolve_server_args", "spec_from_server_args", "request_sampling",
           "unsupported_request"]

#: The algorithm name users pass to ``--speculative-algorithm``.
NAME = "DYNTREE"
#: Path of the JSON options file (inherited by SGLang's spawned scheduler processes).
ENV = "DYNTREE_SGLANG_CONFIG"
#: Attention backends whose TARGET_VERIFY reads a custom (tree) mask.
TREE_MASK_BACKENDS = ("triton", "flashinfer", "fa3", "intel_amx")
#: SGLang's ``--speculative-draft-model-quantization`` choices that mean int4 weight-only: the
#: self-draft then quantizes the target's weights as ``qspec:w4a16,g64`` (round-to-nearest, group 64).
INT4_WEIGHT_ONLY = ("awq", "awq_marlin", "gptq", "gptq_marlin", "moe_wna16")
INT4_DRAFT = "qspec:w4a16,g64"
#: Budget-like fields owned by SGLang's flags, never set in the options file.
_FLAG_FIELDS = {
    "max_nodes": "--speculative-num-draft-tokens",
    "max_depth": "--speculative-num-steps",
}


def load_options() -> dict[str, Any]:
    """The options file's JSON object (``{}`` when ``DYNTREE_SGLANG_CONFIG`` is unset)."""
    path = os.environ.get(ENV)
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise OptionsError(f"{ENV}={path}: no such file (it names a JSON file of dyntree options)")
    try:
        opts = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise OptionsError(f"{ENV}={path}: not valid JSON: {exc}") from None
    if not isinstance(opts, dict):
        raise OptionsError(f"{ENV}={path}: must hold a JSON object of dyntree options, got {type(opts).__name__}")
    for field, flag in _FLAG_FIELDS.items():
        if field in opts:
            raise OptionsError(f"{ENV}={path}: {field!r} is set by SGLang's {flag}; remove it from the file")
    return opts


def spec_from_server_args(sa: Any) -> SpecConfig:
    """The speculation config of resolved server args (flags + options file)."""
    opts = load_options()
    where = f"dyntree options ({ENV})" if os.environ.get(ENV) else "dyntree options"
    n = sa.speculative_num_draft_tokens
    if n is not None:
        if int(n) < 2:
            raise OptionsError(f"--speculative-num-draft-tokens {n}: DYNTREE needs >= 2 (the root plus one draft)")
        opts["max_nodes"] = int(n) - 1
    if sa.speculative_num_steps is not None:
        opts["max_depth"] = int(sa.speculative_num_steps)
    k = sa.speculative_eagle_topk
    if k is not None:
        tree_options = dict(opts.get("tree_options") or {})
        tree_options["max_children"] = int(k)
        opts["tree_options"] = tree_options
    method = _explicit_draft_quantization(sa)
    if method is not None:
        drafter = str(opts.get("drafter", "auto"))
        name = drafter.partition(":")[0].strip().lower()
        if name not in ("auto", "qspec"):
            raise OptionsError(f"--speculative-draft-model-quantization {method} selects the quantized self-draft, but "
                               f"the options file sets drafter {drafter!r}; drop one of them")
        if name == "auto":
            if method not in INT4_WEIGHT_ONLY:
                raise OptionsError(f"--speculative-draft-model-quantization {method}: DYNTREE's self-draft quantizes the "
                                   f"target's weights to int4 for {', '.join(INT4_WEIGHT_ONLY)}; other precisions go in "
                                   "the options file (drafter \"qspec:w8a16\", ...)")
            opts["drafter"] = INT4_DRAFT
    path = sa.speculative_draft_model_path
    if path:
        drafter = str(opts.get("drafter", "auto"))
        if drafter.partition(":")[0].strip().lower() not in ("auto", "hydra") or ":" in drafter:
            raise OptionsError(f"--speculative-draft-model-path {path} names Hydra heads, but the options file sets "
                               f"drafter {drafter!r}; drop one of them")
        opts["drafter"] = f"hydra:{path}"
    spec = parse_spec_options(opts, where, "SGLang")
    if spec.max_nodes < 1:
        raise OptionsError("dyntree options: max_nodes must be >= 1")
    if spec.max_depth > spec.max_nodes:
        raise OptionsError(f"--speculative-num-steps {spec.max_depth}: deeper than the node budget "
                           f"(--speculative-num-draft-tokens {spec.max_nodes + 1} = root + {spec.max_nodes})")
    return spec


def _explicit_draft_quantization(sa: Any) -> str | None:
    """``--speculative-draft-model-quantization`` when the user set it (SGLang copies the target's
    ``--quantization`` into it when unset, which says nothing about DYNTREE's draft)."""
    method = sa.speculative_draft_model_quantization
    explicit = getattr(sa, "_speculative_draft_quantization_explicitly_set", None)
    if not method or method == "unquant" or explicit is False:
        return None
    if explicit is None and method == getattr(sa, "quantization", None):
        return None
    return str(method)


def resolve_server_args(sa: Any) -> SpecConfig:
    """SGLang's ``handle_server_args`` for DYNTREE: fill defaults, then refuse what cannot work.

    ``sa`` is SGLang's write recorder (attribute writes become resolution declarations)."""
    spec = spec_from_server_args(sa)
    sa.speculative_num_draft_tokens = spec.max_nodes + 1
    sa.speculative_num_steps = spec.max_depth
    sa.speculative_eagle_topk = spec.tree_options.max_children
    sa.disable_overlap_schedule = True  # the worker is synchronous (spec V2 schema, no overlap)
    if sa.max_running_requests is None:
        sa.max_running_requests = 48
    problems = []
    if sa.enable_mixed_chunk:
        problems.append("--enable-mixed-chunk (DYNTREE verifies decode-only batches)")
    backends = {flag: getattr(sa, field) for flag, field in (
        ("--attention-backend", "attention_backend"), ("--prefill-attention-backend", "prefill_attention_backend"),
        ("--decode-attention-backend", "decode_attention_backend")) if getattr(sa, field) is not None}
    for flag, backend in backends.items():
        if backend not in TREE_MASK_BACKENDS:
            problems.append(f"{flag} {backend} (it ignores tree masks; use one of {', '.join(TREE_MASK_BACKENDS)})")
        elif backend == "fa3" and spec.tree_options.max_children < 2:
            problems.append(f"{flag} fa3 with --speculative-eagle-topk 1 (fa3 reads tree masks only for topk > 1)")
    if not backends:
        problems.append("no --attention-backend resolved (pass one of " + ", ".join(TREE_MASK_BACKENDS) + ")")
    backend = sa.attention_backend
    if int(sa.page_size or 1) != 1 and backend != "flashinfer":
        problems.append(f"--page-size {sa.page_size} (trees need page size 1 except on flashinfer)")
    if int(sa.tp_size) > 1:
        problems.append(f"--tp-size {sa.tp_size} (trees are drafted per rank and not yet made identical across ranks)")
    if int(sa.pp_size) > 1:
        problems.append(f"--pp-size {sa.pp_size}")
    if sa.enable_dp_attention:
        problems.append("--enable-dp-attention")
    if str(sa.disaggregation_mode) != "null":
        problems.append(f"--disaggregation-mode {sa.disaggregation_mode}")
    if sa.speculative_use_rejection_sampling:
        problems.append("--speculative-use-rejection-sampling (chain-only; DYNTREE verifies trees with its own "
                        "lossless sampler)")
    for flag, value in (("--speculative-accept-threshold-single", sa.speculative_accept_threshold_single),
                        ("--speculative-accept-threshold-acc", sa.speculative_accept_threshold_acc)):
        if value is not None and float(value) != 1.0:
            problems.append(f"{flag} {value} (a threshold below 1 changes the output distribution)")
    if problems:
        raise OptionsError("--speculative-algorithm DYNTREE cannot run with " + "; ".join(problems))
    return spec


def request_sampling(p: Any) -> SamplingParams:
    """SGLang's per-request ``SamplingParams`` -> the core's (greedy is SGLang's ``top_k == 1``)."""
    if p.top_k == 1 or p.temperature == 0:
        return SamplingParams()
    top_k = 0 if p.top_k is None or p.top_k < 0 or p.top_k >= 1 << 30 else int(p.top_k)
    return SamplingParams(temperature=float(p.temperature), top_k=top_k, top_p=float(p.top_p))


def unsupported_request(req: Any) -> str | None:
    """Why tree verification cannot serve this request exactly (``None``: it can)."""
    p = req.sampling_params
    checks = [
        (p.frequency_penalty != 0.0, "frequency_penalty"), (p.presence_penalty != 0.0, "presence_penalty"),
        (p.repetition_penalty != 1.0, "repetition_penalty"), (p.min_p > 0.0, "min_p"),
        (bool(getattr(p, "logit_bias", None)), "logit_bias"),
        (any(getattr(p, g, None) for g in ("json_schema", "regex", "ebnf", "structural_tag")), "structured output"),
        (bool(getattr(req, "return_logprob", False)), "logprobs"),
    ]  # fmt: skip
    bad = [name for cond, name in checks if cond]
    return f"{', '.join(bad)} not supported with tree speculation yet" if bad else None
