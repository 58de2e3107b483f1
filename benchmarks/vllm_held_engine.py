"""One vLLM engine held open for ``vllm_paired.py``, which times several engines in turn.

    python benchmarks/vllm_held_engine.py CONTROL_FD CHECKPOINT --label 50% --mode auto ...

Run it with the serving environment's Python. After the descriptor ``CONTROL_FD`` come
``vllm_engine.py``'s options; the engine starts as there, and writes what it holds once
loaded (``vllm_engine.start_engine``'s result) as one JSON line to the descriptor. It then
reads one command a line from stdin and answers each with one JSON line:

- ``warm WORKLOAD``: the workload's first two prompts, untimed;
- ``time WORKLOAD``: the whole workload once, timed (``seconds``, ``tokens_per_s``).

At the end of its input it writes its peak resident memory (``rss_peak``) and ends.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_engine import (  # noqa: E402
    Workload,
    parse_args,
    prompts_for,
    resident_bytes,
    run_workload,
    start_engine,
)


def answer(control, payload: dict) -> None:
    control.write(json.dumps(payload, default=str) + "\n")
    control.flush()


def serve(args, control, commands) -> None:
    llm, result, config = start_engine(args)
    answer(control, result)
    workloads = {}
    for text in args.workloads:
        workload = Workload.parse(text)
        workloads[workload.name] = (workload, prompts_for(workload, config["vocab_size"]))
    for line in commands:
        verb, name = line.split()
        workload, prompts = workloads[name]
        if verb == "warm":
            run_workload(llm, workload, prompts[:2])
            answer(control, {"warm": name})
            continue
        seconds = run_workload(llm, workload, prompts)
        answer(
            control,
            {
                "workload": name,
                "seconds": seconds,
                "tokens_per_s": workload.counted_tokens / seconds,
            },
        )
    answer(control, {"rss_peak": resident_bytes("VmHWM")})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].isdigit():
        raise SystemExit("usage: vllm_held_engine.py CONTROL_FD CHECKPOINT [vllm_engine options]")
    with os.fdopen(int(argv[0]), "w") as control:
        serve(parse_args(argv[1:]), control, sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
