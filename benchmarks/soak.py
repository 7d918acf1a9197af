"""Soak test: offloading cameras against a real ``incrinf serve`` that is killed and restarted, for thousands of
frames each; then a long local ``StreamSession`` run. Nothing may be lost and memory must stay flat.

Setup (all on this machine, loopback only):

- the server is a real ``incrinf serve`` subprocess (``--token-file`` with one token per camera, so every camera is
  its own credential with its own limits; 1 torch thread), killed with SIGKILL and restarted on the same port
  ``--restarts`` times, evenly spread over the run;
- the cameras are threads of this process (one :class:`~incrinf.offload.session.OffloadingSession` each, all on
  ONE shared model instance, 1 torch thread each), with mixed policies (``auto``, ``offload_full``,
  ``offload_changed_pixels``, ``hybrid``), a per-frame budget, and a local device emulated ``--slowdown`` times slower
  than the server (sleeps, so the machine's cores stay with the server);
- every request goes through one :class:`~incrinf.testing.shaping.ShapingProxy` (a link shared by all cameras)
  that replays a looping bandwidth/latency trace;
- frames: a virtual camera panning over the sample photo with a moving object, played back and forth (a camera
  that never stops), a different start per camera.

Checked and printed: frames sent vs outputs received per camera (every call must return the frame's output,
from the server or computed locally); spot checks every ``--check-every`` frames against full local inference
(exact options must agree to float tolerance: offload_full, hybrid, local_full; cached options report top-1
agreement); latency p50/p99 per policy; resident memory of the server and of the client process sampled over
time, with the drift after warm-up (median of the last quarter of the samples over the median of the first
quarter, after the first ``--warmup`` of the run; per server process, since a restart starts a new one).

Then a long local run: one ``StreamSession`` on ``--local-frames`` small frames of a camera that pans and pauses
(the still-camera cached path and the moving-camera fallbacks in turn), memory sampled the same way.

Run: ``python benchmarks/soak.py`` (4 cameras x 5,000 frames; about half an hour on 2 cores) or
``python benchmarks/soak.py --quick`` (a smoke run of a minute or two).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

try:
    import incrinf  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine  # noqa: E402

from incrinf import models  # noqa: E402
from incrinf.offload.session import OffloadingSession  # noqa: E402
from incrinf.stream.session import StreamSession  # noqa: E402
from incrinf.testing.shaping import ShapingProxy  # noqa: E402
from incrinf.testing.synthetic import synthetic_camera  # noqa: E402

POLICIES = ("auto", "offload_full", "offload_changed_pixels", "hybrid")
EXACT = ("offload_full", "local_full", "hybrid")  # options whose output equals full inference
# (seconds, Mbit/s, one-way latency ms), looped: Wi-Fi that comes and goes
TRACE = [(8.0, 40.0, 2.0), (6.0, 4.0, 10.0), (8.0, 100.0, 1.0), (5.0, 1.5, 25.0), (6.0, 20.0, 5.0)]
SERVE = "import sys; from incrinf.cli import main; sys.exit(main(sys.argv[1:]))"


def rss_of(pid: int | str = "self") -> int | None:
    """Resident memory of a process in bytes (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``incrinf serve`` as a subprocess that can be SIGKILLed and started again on the same port."""

    def __init__(self, args: argparse.Namespace, port: int, token_file: Path, log: Path) -> None:
        self.cmd = [sys.executable, "-c", SERVE, "serve", "--model", args.model, "--input",
                    f"3x{args.size}x{args.size}", "--port", str(port), "--token-file", str(token_file),
                    "--threads", "1", "--workers", "2", "--timing-repeats", "2"]
        self.env = {k: v for k, v in os.environ.items() if k != "INCRINF_TOKEN"}
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.generation = 0
        self.ready_at: dict[int, float] = {}  # generation -> when it started serving (monotonic)

    def start(self, timeout: float = 120.0) -> float:
        """Start and wait until it serves; returns the seconds it took."""
        t0 = time.monotonic()
        self.generation += 1
        log = open(self.log, "a")  # noqa: SIM115 (handed to the child, closed below)
        log.write(f"--- generation {self.generation}\n")
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env)
        ready = threading.Event()

        def drain(proc: subprocess.Popen) -> None:  # keep the pipe empty for the server's whole life
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if " on http" in line:
                    ready.set()
            log.close()

        threading.Thread(target=drain, args=(self.proc,), daemon=True).start()
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"incrinf serve did not start (see {self.log})")
        self.ready_at[self.generation] = time.monotonic()
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


@dataclass
class Sample:
    at: float
    frames: int
    client_rss: int
    server_rss: int | None
    generation: int


class MemorySampler:
    """RSS of this process and of the server, every ``interval`` seconds."""

    def __init__(self, interval: float, progress, server: ServerProcess | None = None) -> None:
        self.interval, self.progress, self.server = interval, progress, server
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            pid = self.server.pid if self.server is not None else None
            self.samples.append(Sample(time.monotonic(), self.progress(), rss_of() or 0,
                                       rss_of(pid) if pid else None, self.server.generation if self.server else 0))

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class CameraResult:
    policy: str
    sent: int = 0
    received: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    modes: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    local_why: Counter = field(default_factory=Counter)  # why frames of an offloading policy ran locally
    exact_checked: int = 0
    exact_mismatches: int = 0
    approx_checked: int = 0
    approx_top1: int = 0
    indices_ok: bool = True
    construct_seconds: float = 0.0


def camera_frames(seed: int, size: int, n: int) -> list[np.ndarray]:
    """A back-and-forth camera: 0, 1, ..., n-1, n-2, ..., 1, 0, 1, ... (consecutive frames always adjacent)."""
    frames = [f for f, _ in synthetic_camera(models.sample_image(), n, size=(size, size), motion="pan", seed=seed,
                                             insert_object=True)]
    return frames + frames[-2:0:-1]


def pausing_camera(seed: int, size: int, n: int, still: int = 150) -> list[np.ndarray]:
    """A camera that pans for a while, then stops for ``still`` frames while an object moves in the view, and so
    on: the local session's still-camera (cached) path and its moving-camera fallbacks in turn."""
    pan = camera_frames(seed, size, n)
    rng = np.random.default_rng(seed)
    frames: list[np.ndarray] = []
    for k in range(0, len(pan), 50):
        frames += pan[k:k + 50]
        base = frames[-1]
        y, x = rng.integers(0, size - 12, size=2)
        dy, dx = rng.choice([-1, 1], size=2)
        for _ in range(still):
            frame = base.copy()
            frame[y:y + 12, x:x + 12] = (255, 64, 0)
            frames.append(frame)
            y, x = int(np.clip(y + dy, 0, size - 12)), int(np.clip(x + dx, 0, size - 12))
    return frames


def run_camera(index: int, policy: str, url: str, token: str, model: torch.nn.Module, args: argparse.Namespace,
               frames: list[np.ndarray], result: CameraResult, progress: list[int], start: threading.Barrier) -> None:
    torch.set_num_threads(1)
    meta = models.info(args.model)
    normalization = meta.normalization
    start.wait()
    t0 = time.monotonic()
    session = OffloadingSession(model, offload=url, policy=policy, token=token, input_size=(args.size, args.size),
                                mean=meta.mean, std=meta.std, budget=args.budget, max_timeout=1.0,
                                local_slowdown=args.slowdown, backoff_initial=0.1, backoff_cap=2.0,
                                timing_repeats=2)
    result.construct_seconds = time.monotonic() - t0
    with session:
        for k in range(args.frames):
            frame = frames[k % len(frames)]
            result.sent += 1
            t0 = time.perf_counter()
            try:
                out = session(frame)
            except Exception as exc:  # a lost frame: counted, never hidden
                result.errors.append(f"frame {k}: {type(exc).__name__}: {exc}")
                continue
            finally:
                progress[index] += 1
            result.latencies.append(time.perf_counter() - t0)
            if isinstance(out, torch.Tensor) and out.shape == (1, 1000) and bool(torch.isfinite(out).all()):
                result.received += 1
            else:
                result.errors.append(f"frame {k}: bad output {type(out).__name__} {getattr(out, 'shape', '')}")
            stats = session.stats[-1]
            result.indices_ok &= stats.index == k
            result.modes[stats.mode.policy.value] += 1
            if stats.fallback:
                result.fallbacks[(stats.error or "").split(":")[0]] += 1
            if not stats.mode.offloads:
                result.local_why[_local_why(stats)] += 1
            if k % args.check_every == 0:
                with torch.no_grad():
                    ref = model(normalization.tensor(frame))
                if stats.mode.policy.value in EXACT:
                    result.exact_checked += 1
                    scale = ref.abs().max().item()
                    result.exact_mismatches += int((out - ref).abs().max().item() > 1e-3 * scale)
                else:
                    result.approx_checked += 1
                    result.approx_top1 += int(out.argmax().item() == ref.argmax().item())


def _local_why(stats) -> str:
    if stats.fallback:
        return "offload failed"
    if "server down" in stats.reason:
        return "server in back-off"
    if "exceed the timeout" in stats.reason:
        return "predicted over budget"
    return "chosen"


def drift(values: list[float]) -> tuple[float, float, float]:
    """``(baseline MiB, last-quarter drift %, max drift %)`` of a series already past warm-up."""
    if len(values) < 4:
        return (values[0] / 2**20 if values else math.nan), math.nan, math.nan
    q = max(1, len(values) // 4)
    first, last = statistics.median(values[:q]), statistics.median(values[-q:])
    return first / 2**20, 100 * (last / first - 1), 100 * (max(values) / first - 1)


def percentile(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) * 1e3 if values else math.nan


def soak(args: argparse.Namespace) -> bool:
    torch.set_num_threads(1)
    n_cameras = len(args.policies)
    tokens = [f"camera-{i}-{os.urandom(12).hex()}" for i in range(n_cameras)]
    workdir = Path(tempfile.mkdtemp(prefix="incrinf-soak-"))
    token_file = workdir / "tokens"
    token_file.write_text("".join(t + "\n" for t in tokens))
    token_file.chmod(0o600)
    port = free_port()
    server = ServerProcess(args, port, token_file, workdir / "server.log")
    print(f"server log: {server.log}", flush=True)
    seconds = server.start()
    print(f"incrinf serve up in {seconds:.1f} s (pid {server.pid})", flush=True)
    model = models.load(args.model)
    progress = [0] * n_cameras
    results = [CameraResult(policy) for policy in args.policies]
    cameras = [camera_frames(i, args.size, args.camera_frames) for i in range(n_cameras)]
    total = args.frames * n_cameras
    kills_at = [total * (i + 1) // (args.restarts + 1) for i in range(args.restarts)]
    events: list[str] = []
    t_start = time.monotonic()
    with ShapingProxy(port, trace=TRACE, loop=True) as proxy, \
            MemorySampler(args.sample_every, lambda: sum(progress), server) as sampler:
        url = f"http://127.0.0.1:{proxy.port}"
        start = threading.Barrier(n_cameras)
        threads = [threading.Thread(target=run_camera, name=f"camera-{i}", args=(
            i, policy, url, tokens[i], model, args, cameras[i], results[i], progress, start))
            for i, policy in enumerate(args.policies)]
        for thread in threads:
            thread.start()
        for at in kills_at:
            while sum(progress) < at and any(t.is_alive() for t in threads):
                time.sleep(0.05)
            server.kill()
            events.append(f"{time.monotonic() - t_start:7.1f} s, frame {sum(progress)}: server SIGKILLed")
            time.sleep(args.down)
            seconds = server.start()
            events.append(f"{time.monotonic() - t_start:7.1f} s, frame {sum(progress)}: server serving again "
                          f"({seconds:.1f} s to start)")
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - t_start
    server.stop()
    samples = sampler.samples

    print(f"\n{machine()}")
    print(f"{n_cameras} cameras x {args.frames} frames, {args.model} at {args.size}x{args.size}, budget "
          f"{args.budget * 1e3:.0f} ms, local device {args.slowdown:g}x slower, link trace {TRACE} (looped), "
          f"{args.restarts} SIGKILL + restart; {elapsed:.0f} s")
    for line in events:
        print("  " + line)
    print("\n| camera | policy | frames sent | outputs received | lost | errors | p50 ms | p99 ms | max ms | "
          "modes | fallbacks (cause) | exact checks (mismatch) | cached top-1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for i, r in enumerate(results):
        lost = r.sent - r.received
        ok &= lost == 0 and not r.errors and r.exact_mismatches == 0 and r.indices_ok and r.sent == args.frames
        modes = ", ".join(f"{m} {c}" for m, c in r.modes.most_common())
        falls = ", ".join(f"{m} {c}" for m, c in r.fallbacks.most_common()) or "0"
        top1 = f"{r.approx_top1}/{r.approx_checked}" if r.approx_checked else "-"
        print(f"| {i} | {r.policy} | {r.sent} | {r.received} | {lost} | {len(r.errors)} | "
              f"{percentile(r.latencies, 50):.1f} | {percentile(r.latencies, 99):.1f} | "
              f"{percentile(r.latencies, 100):.1f} | {modes} | {falls} | {r.exact_checked} ({r.exact_mismatches}) | "
              f"{top1} |")
        for error in r.errors[:5]:
            print(f"    {error}")
    for i, r in enumerate(results):
        print(f"  camera {i} ({r.policy}) ran {sum(r.local_why.values())} frames locally: "
              + ", ".join(f"{why} {n}" for why, n in r.local_why.most_common()))
    sent, received = sum(r.sent for r in results), sum(r.received for r in results)
    print(f"\nframes sent {sent}, outputs received {received}, lost {sent - received}")

    warm = [s for s in samples if s.frames >= args.warmup * total]
    base, last, peak = drift([s.client_rss for s in warm])
    print(f"\nmemory after warm-up ({args.warmup:.0%} of the frames), {len(samples)} samples every "
          f"{args.sample_every:g} s:")
    print(f"  client process: {base:.0f} MiB, drift {last:+.1f}% (max {peak:+.1f}%)")
    flat = abs(last) <= 5
    for generation in sorted({s.generation for s in samples if s.server_rss}):
        # from when it serves (loading the model is not a leak), past its own warm-up: the first fifth of that
        series = [s.server_rss for s in samples
                  if s.generation == generation and s.server_rss and s.at >= server.ready_at[generation]]
        base, last, peak = drift(series[max(1, len(series) // 5):])
        print(f"  server process {generation}: {base:.0f} MiB, drift {last:+.1f}% (max {peak:+.1f}%) over "
              f"{len(series)} samples while serving")
        flat &= not (abs(last) > 5)
    t0 = samples[0].at if samples else 0.0
    series = ", ".join(f"{s.at - t0:.0f}s:{s.client_rss / 2**20:.0f}/{(s.server_rss or 0) / 2**20:.0f}"
                       for s in samples[:: max(1, len(samples) // 24)])
    print(f"  over time (s: client/server MiB): {series}")
    print(f"\nsoak {'PASSED' if ok else 'FAILED'}: {'nothing lost' if ok else 'frames lost or wrong'}; memory "
          f"{'flat' if flat else 'NOT flat'} within 5%")
    return ok and flat


def local_run(args: argparse.Namespace) -> bool:
    """One StreamSession on many small frames, memory sampled."""
    torch.set_num_threads(1)
    model = models.load(args.model)
    frames = pausing_camera(7, args.size, args.camera_frames)
    session = StreamSession(model)
    done = [0]
    received = 0
    t0 = time.monotonic()
    with MemorySampler(args.sample_every, lambda: done[0]) as sampler:
        for k in range(args.local_frames):
            out = session(frames[k % len(frames)])
            received += int(out.shape == (1, 1000) and bool(torch.isfinite(out).all()))
            done[0] += 1
    elapsed = time.monotonic() - t0
    modes = Counter(s.mode for s in session.stats)
    warm = [s.client_rss for s in sampler.samples if s.frames >= args.warmup * args.local_frames]
    base, last, peak = drift(warm)
    stats_bytes = len(session.stats) * 700  # about 0.7 KB per FrameStats record (measured with tracemalloc)
    print(f"\nlocal StreamSession: {args.local_frames} frames of {args.size}x{args.size} in {elapsed:.0f} s "
          f"({elapsed / args.local_frames * 1e3:.1f} ms/frame), outputs {received}, modes {dict(modes)}")
    print(f"  memory after warm-up: {base:.0f} MiB, drift {last:+.1f}% (max {peak:+.1f}%); of it, session.stats "
          f"holds {len(session.stats)} records (~{stats_bytes / 2**20:.1f} MiB, unbounded)")
    ok = received == args.local_frames and abs(last) <= 5
    print(f"local run {'PASSED' if ok else 'FAILED'}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=5000, help="frames per camera (default 5000)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), help=f"one camera per policy {POLICIES}")
    p.add_argument("--model", default="efficientnet_lite0")
    p.add_argument("--size", type=int, default=64, help="frame side in pixels (default 64)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds per frame (default 0.25)")
    p.add_argument("--slowdown", type=float, default=3.0, help="local device this many times slower (default 3)")
    p.add_argument("--restarts", type=int, default=2, help="server SIGKILLs + restarts (default 2)")
    p.add_argument("--down", type=float, default=3.0, help="seconds the server stays dead (default 3)")
    p.add_argument("--check-every", type=int, default=25, help="spot-check every this many frames (default 25)")
    p.add_argument("--camera-frames", type=int, default=200, help="distinct frames per camera (default 200)")
    p.add_argument("--sample-every", type=float, default=2.0, help="memory sampling interval s (default 2)")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run before memory counts (default 0.2)")
    p.add_argument("--local-frames", type=int, default=10000, help="frames of the local run (default 10000)")
    p.add_argument("--skip-local", action="store_true", help="only the offload soak")
    p.add_argument("--skip-offload", action="store_true", help="only the local run")
    p.add_argument("--quick", action="store_true", help="smoke run: 300 frames per camera, 1,000 local frames")
    args = p.parse_args()
    if args.quick:
        args.frames, args.local_frames, args.sample_every, args.down = 300, 1000, 0.5, 1.0
    ok = True
    if not args.skip_offload:
        ok &= soak(args)
    if not args.skip_local:
        ok &= local_run(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
