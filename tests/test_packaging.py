"""Installing: never two onnxruntime distributions, one CUDA recipe, install hints that work.

``onnxruntime``, ``onnxruntime-gpu`` and ``onnxruntime-directml`` all write the same
``onnxruntime`` package; two of them in one environment overwrite each other's files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from sharedml._host import _onnxruntime

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = {"linux": "Linux", "win32": "Windows", "darwin": "Darwin"}


def project() -> dict[str, object]:
    data: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return data


def wanted(requirements: list[str], sys_platform: str) -> list[Requirement]:
    env = default_environment() | {
        "sys_platform": sys_platform,
        "platform_system": PLATFORMS[sys_platform],
    }
    parsed = [Requirement(r) for r in requirements]
    return [r for r in parsed if r.marker is None or r.marker.evaluate(env)]


def ort_names(requirements: list[Requirement]) -> list[str]:
    return [r.name for r in requirements if r.name in _onnxruntime.ORT_DISTRIBUTIONS]


@pytest.mark.parametrize("sys_platform", sorted(PLATFORMS))
def test_no_extra_adds_a_second_onnxruntime(sys_platform: str) -> None:
    base = project()["dependencies"]
    assert isinstance(base, list)
    assert len(ort_names(wanted(base, sys_platform))) == 1
    extras = project()["optional-dependencies"]
    assert isinstance(extras, dict)
    for extra, requirements in extras.items():
        assert ort_names(wanted(base + requirements, sys_platform))[1:] == [], extra


def test_the_cuda_recipe_is_the_dependencies_with_onnxruntime_gpu_instead() -> None:
    lines = (ROOT / "requirements" / "cuda.txt").read_text().splitlines()
    cuda = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    assert ort_names(cuda) == ["onnxruntime-gpu"]
    base = project()["dependencies"]
    assert isinstance(base, list)
    others = sorted(
        str(r) for r in wanted(base, "linux") if r.name not in _onnxruntime.ORT_DISTRIBUTIONS
    )
    assert sorted(str(r) for r in cuda if r.name != "onnxruntime-gpu") == others
    readme = (ROOT / "README.md").read_text()
    assert "pip install -r requirements/cuda.txt && pip install --no-deps ." in readme


DETECT = r"""
import sys, warnings
import sharedml
from sharedml.runtime import _providers
assert 'onnxruntime' not in sys.modules  # import sharedml alone checks nothing
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _providers.plan_providers(None)
    _providers.plan_providers(None)
print(len(caught))
for w in caught:
    print(w.category.__name__, w.message)
"""


def fake_distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def run_detect(*sites: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, sites), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", DETECT], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


# The child finds the fake site through PYTHONPATH, which some Pythons ignore (Python's
# embeddable Windows build, whose ._pth file isolates it, as tools/windows/ uses).
needs_pythonpath = pytest.mark.skipif(
    bool(sys.flags.ignore_environment), reason="this Python ignores PYTHONPATH"
)


@needs_pythonpath
def test_two_onnxruntime_distributions_in_one_folder_are_detected_when_first_needed(
    tmp_path: Path,
) -> None:
    # One folder that two installs wrote: the real package (linked) and both records.
    import onnxruntime

    (tmp_path / "onnxruntime").symlink_to(Path(onnxruntime.__file__).parent)
    fake_distribution(tmp_path, "onnxruntime", onnxruntime.__version__)
    fake_distribution(tmp_path, "onnxruntime-gpu", "1.20.0")
    first, *warned = run_detect(tmp_path)
    assert first == "1", warned  # once per process
    assert warned[0].startswith("RuntimeWarning sharedml: 2 onnxruntime distributions")
    assert str(tmp_path) in warned[0] and "onnxruntime-gpu 1.20.0" in warned[0]
    fix = "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu"
    assert fix in warned[0]


@needs_pythonpath
def test_an_onnxruntime_installed_in_a_folder_of_its_own_is_not_mixed(tmp_path: Path) -> None:
    # pip install --target DIR onnxruntime-gpu, DIR on PYTHONPATH: sys.path order decides, and
    # the folder imported from holds one distribution.
    import onnxruntime

    own = tmp_path / "own"
    (own / "onnxruntime").parent.mkdir()
    (own / "onnxruntime").symlink_to(Path(onnxruntime.__file__).parent)
    fake_distribution(own, "onnxruntime-gpu", "1.20.0")
    assert run_detect(own) == ["0"]
    # and a record elsewhere on the path, shadowed by the package imported, is not either
    other = tmp_path / "other"
    fake_distribution(other, "onnxruntime-gpu", "1.20.0")
    assert run_detect(other) == ["0"]


def test_one_onnxruntime_distribution_says_nothing() -> None:
    assert len(_onnxruntime.onnxruntime_distributions()) == 1
    _onnxruntime.check_one_onnxruntime.cache_clear()
    assert _onnxruntime.check_one_onnxruntime() is None


def test_an_install_hint_works_without_a_package_index() -> None:
    from sharedml._errors import missing_package

    text = str(missing_package("--plot", "matplotlib", "plot"))
    assert "pip install matplotlib" in text and "pip install '.[plot]'" in text
    assert "pip install 'sharedml[" not in text  # sharedml is not on a package index
    for source in (ROOT / "src" / "sharedml").glob("*.py"):
        assert "pip install 'sharedml[" not in source.read_text().replace(
            "``pip install 'sharedml[extra]'`` would not find it", ""
        ), source.name


def test_the_windows_harness_pins_every_dependency_windows_installs() -> None:
    # tools/windows/setup.sh installs its pinned wheels only (sharedml runs from src/): a
    # dependency the package gains must be pinned there too, or the DirectML job fails to import.
    pins: dict[str, str] = {}
    for line in (ROOT / "tools" / "windows" / "requirements.txt").read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name, _, version = line.split(" ", 1)[0].partition("==")
            pins[name.lower().replace("_", "-")] = version
    base = project()["dependencies"]
    assert isinstance(base, list)
    for requirement in wanted(base, "win32"):
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in tools/windows/requirements.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name])
