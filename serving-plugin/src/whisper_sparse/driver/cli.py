"""``whisper-serve``: serve a checkpoint with vLLM's OpenAI-compatible server.

    whisper-serve outputs/SmolLM2-135M-Instruct-whisper_2of4_w8a8
    whisper-serve CHECKPOINT --port 8001 --max-model-len 2048 -- --max-num-seqs 4

Checks the checkpoint, then replaces itself with the server from the serving environment
(``scripts/setup_serving.sh``; ``--python`` or ``$WHISPER_MODIFIERS_SERVING_PYTHON`` for
another), with vLLM's CPU defaults set on a machine without a GPU. Arguments after ``--``
go to vLLM unchanged. Stop the server with Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys

VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="whisper-serve",
        description="Serve a checkpoint with vLLM's OpenAI-compatible server "
        "(arguments after -- go to vLLM).",
    )
    parser.add_argument("checkpoint", help="a directory written by whisper-prune or oneshot")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--python", default=None, help="the serving environment's Python")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=VLLM_DTYPES,
        help="vLLM's --dtype (default: measured, see serving.serving_dtype)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests give the model (default: the checkpoint as given here; "
        "its directory's name is accepted too)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command instead of running it"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must lie in 1..65535; got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be at least 1; got {args.max_model_len}")
    if not args.dry_run and not port_is_free(args.host, args.port):
        parser.error(f"--port {args.port} on {args.host} is already in use; choose another")
    args.extra = extra
    return args


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def main(argv=None) -> int:
    from whisper_sparse.driver import (
        names_the_model,
        serve_command,
        served_model_names,
        serving_env,
    )

    args = parse_args(argv)
    try:
        command = serve_command(
            args.checkpoint,
            host=args.host,
            port=args.port,
            python=args.python,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            extra_args=args.extra,
            served_model_name=args.served_model_name,
        )
    except (FileNotFoundError, ValueError) as error:  # ServingUnavailable too
        print(f"whisper-serve: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # the serving environment's kernel probe failed
        print(f"whisper-serve: error: {error}", file=sys.stderr)
        return 1
    print("+ " + shlex.join(command), flush=True)
    if not names_the_model(args.extra):
        names = served_model_names(args.checkpoint, args.served_model_name)
        aliases = "".join(f" (or {name!r})" for name in names[1:])
        print(f"requests name the model {names[0]!r}{aliases}", flush=True)
    if args.dry_run:
        return 0
    os.execve(command[0], command, serving_env())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
