"""Parses and resolves ``sglang.launch_server`` arguments the way SGLang does before it serves
(plugins loaded, ``prepare_server_args``, ``resolve_once``), then prints ``RESULT`` + JSON of the
resolved speculative fields, or of the error. Needs the torchvision stub on ``PYTHONPATH``.

    python tests/sglang_resolve.py --model-path M --speculative-algorithm dyntree ...
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(sys.argv[1:])
    try:
        sa.resolve_once()
        v = resolving_view(sa)
        out = {name: getattr(v, name) for name in (
            "speculative_algorithm", "speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
            "disable_overlap_schedule", "max_running_requests", "attention_backend")}
        out["decode_cuda_graph"] = v.cuda_graph_config.decode.backend
        out["options_file"] = os.environ.get("DYNTREE_SGLANG_CONFIG")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULT" + json.dumps(out))
