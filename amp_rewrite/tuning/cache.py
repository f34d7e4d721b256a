"""The timing cache: seconds per op signature, per machine, in one plain JSON file.

A timing holds only for the machine that measured it, so the file keeps one section per
machine: its CPU model, flags and usable cores, the GPU where the target runs there, the
TensorFlow version and the environment variables that change oneDNN's kernels. A second
conversion on the same machine reads its section and times only what is missing; a fleet
of identical machines can share one file (copy it to the same place); deleting it costs
only the time to measure again. It lives at ``$XDG_CACHE_HOME/amp_rewrite/timings.json``
(``~/.cache/amp_rewrite/timings.json`` without it) unless a path is given.

A file that cannot be read, or that is not such a cache, is left as it is: the caller
says so in one line (``problem``) and times without it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "amp-rewrite op timings"
VERSION = 1
METHOD = 2  # how timing.py measures: a section measured otherwise is another machine's
# Environment variables under which the same TensorFlow picks other kernels.
KERNEL_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "TF_ENABLE_ONEDNN_OPTS", "DNNL_MAX_CPU_ISA", "TF_NUM_INTRAOP_THREADS",
                    "OMP_NUM_THREADS")


def default_path() -> Path:
    """Where the cache lives unless a path is given (the XDG base directory convention)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "amp_rewrite" / "timings.json"


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and feature flags (Linux ``/proc/cpuinfo``; elsewhere what
    ``platform`` says, without flags)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    return model, sorted((fields.get("flags") or fields.get("Features") or "").split())


def machine_description(gpu: str = "") -> dict[str, object]:
    """What a timing depends on besides the op: shown in the file for people, hashed into its key."""
    import tensorflow as tf  # only here: the cache file is read and written without TensorFlow

    model, flags = _cpu()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"cpu": model, "cores": cores, "flags": " ".join(flags), "gpu": gpu, "tensorflow": tf.version.VERSION,
            "environment": {name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ},
            "method": METHOD}


def machine_key(description: dict[str, object]) -> str:
    """A readable key: the CPU, its cores, the GPU, TensorFlow, and a digest of everything."""
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:12]
    gpu = f", {description['gpu']}" if description.get("gpu") else ""
    return f"{description['cpu']} x{description['cores']}{gpu}, TensorFlow {description['tensorflow']} #{digest}"


@dataclass
class TimingCache:
    """This machine's timings (op signature key -> seconds per run) and the file they come from."""

    path: Path | None                 # None: no file (nothing read, nothing written)
    description: dict[str, object]
    timings: dict[str, float] = field(default_factory=dict)
    problem: str = ""                 # why the file was not used, one line; "" if it was (or is new)
    added: int = 0                    # timings put since loading

    @property
    def key(self) -> str:
        return machine_key(self.description)

    @property
    def usable(self) -> bool:
        """Whether the file may be written: not when it was unreadable or someone else's."""
        return self.path is not None and not self.problem

    def get(self, key: str) -> float | None:
        return self.timings.get(key)

    def put(self, key: str, seconds: float) -> None:
        self.timings[key] = seconds
        self.added += 1

    def text(self) -> str:
        """The file to write: its other machines' sections as they are now on disk (another
        run may have added some), this machine's with what was measured."""
        sections = _read_sections(self.path)[0] if self.path is not None and self.path.exists() else {}
        sections = dict(sections or {})
        sections[self.key] = {"machine": self.description, "timings": dict(sorted(self.timings.items()))}
        return json.dumps({"format": FORMAT, "version": VERSION, "machines": sections}, indent=1, sort_keys=True) + "\n"


def _read_sections(path: Path) -> tuple[dict[str, dict] | None, str]:
    """The file's machine sections, or None and why it cannot be used."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        return None, f"{path}: cannot read the timing cache ({reason})"
    foreign = (f"{path}: not an amp-rewrite timing cache; timing without it (delete the file, or pass"
               " another path, to keep timings)")
    try:
        data = json.loads(text)
    except ValueError:
        return None, foreign
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("machines"), dict):
        return None, foreign
    if data.get("version") != VERSION:
        return None, f"{path}: a timing cache of another version ({data.get('version')!r}); timing without it"
    for section in data["machines"].values():
        timings = section.get("timings") if isinstance(section, dict) else None
        if not isinstance(timings, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in timings.values()):
            return None, foreign
    return data["machines"], ""


def load_cache(path: str | os.PathLike | None, gpu: str = "") -> TimingCache:
    """This machine's section of the cache at ``path`` (None: no file). A missing file is an
    empty cache that will be created; an unreadable or foreign one gives ``problem``."""
    description = machine_description(gpu)
    if path is None:
        return TimingCache(None, description)
    path = Path(path)
    cache = TimingCache(path, description)
    if not path.exists():
        return cache
    if path.is_dir():
        cache.problem = f"{path}: is a directory, not a timing cache file; timing without a cache"
        return cache
    sections, cache.problem = _read_sections(path)
    if sections is not None:
        cache.timings = {key: float(value) for key, value in sections.get(cache.key, {}).get("timings", {}).items()}
    return cache


def gpu_name(device_type: str) -> str:
    """The GPU a target of ``device_type`` runs on here, as the cache's machine names it ("" for the CPU)."""
    if device_type != "GPU":
        return ""
    import tensorflow as tf  # only here: the cache file is read and written without TensorFlow

    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    return f"{details.get('device_name', 'GPU')} sm_{''.join(map(str, details.get('compute_capability', ())))}"


def training_cache(path: str | os.PathLike, device_type: str) -> TimingCache | None:
    """The cache at ``path`` for the live rewrite, which only reads it (at each trace): None,
    with the reason in a warning (once per reason, as warnings go), where it cannot help
    (missing, unreadable, someone else's, or nothing timed on this machine)."""
    cache = load_cache(path, gpu_name(device_type))
    why = cache.problem or ("" if cache.timings else f"{path}: no timings of this machine there"
                            f" (amp_rewrite.tune_step, or amp-rewrite convert --tune speed --tune-cache {path}, fills it)")
    if why:
        warnings.warn(f"amp_rewrite: {why.removesuffix('; timing without a cache')}; the lists decide alone",
                      stacklevel=2)
        return None
    return cache
