"""Without MONAI, Captum or nibabel the drop-ins and volume reading raise errors naming their pip install; the
core occlusion path needs none of them (also for volumes)."""

import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import importlib.abc, sys

    class Missing(importlib.abc.MetaPathFinder):  # as if the optional packages were not installed
        BLOCKED = ("monai", "captum", "nibabel")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ImportError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Missing())
""")


def test_missing_drop_in_extras_name_their_install_command(tmp_path):
    code = BLOCK + textwrap.dedent(f"""
        import torch, torch.nn as nn
        import incrinf
        from incrinf.errors import MissingExtraError
        from incrinf.explain.occlusion import occlusion

        model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                              nn.Linear(2, 2)).eval()
        result = occlusion(model, torch.randn(1, 6, 6, 6), patch=3, stride=3, baseline="gaussian", progress=False)
        assert result.heatmap.shape == (2, 2, 2)
        from incrinf.cli.volume import read_volume
        for load, extra in ((lambda: incrinf.monai, "monai"), (lambda: incrinf.captum, "captum"),
                            (lambda: read_volume({str(tmp_path / "v.nii")!r}), "nifti"),
                            (lambda: incrinf.models.load("monai_densenet121_3d"), "monai")):
            try:
                load()
            except MissingExtraError as exc:
                assert f"pip install 'incrinf[{{extra}}]'" in str(exc), exc
            else:
                raise AssertionError(f"no error without the [{{extra}}] extra")
        print("ok", sorted(m for m in sys.modules if m.split(".")[0] in Missing.BLOCKED))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok []"
