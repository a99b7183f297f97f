"""What the project declares: environment.yml installs what pyproject.toml lists, for the Python it allows, and
tools/lowest_versions.py pins every lower bound (make test-lowest runs the suite on them)."""
import sys
import tomllib

import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import lowest_versions  # noqa: E402  (tools/ is not a package)


def drift(environment: dict, project: dict) -> list[str]:
    """How environment.yml differs from what pyproject.toml declares."""
    found = []
    dependencies = environment["dependencies"]
    if f"python{project['requires-python']}" not in dependencies:
        found.append(f"its python is not pyproject.toml's requires-python ({project['requires-python']})")
    pip = next((item["pip"] for item in dependencies if isinstance(item, dict)), [])
    if pip != ["-e .[dev]"]:
        found.append(f"pip installs {pip}, not the project with its dev extra (-e .[dev]), pyproject.toml's list")
    return found


def declared():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    return environment, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_environment_yml_installs_what_pyproject_declares():
    assert drift(*declared()) == []


def test_a_list_of_its_own_in_environment_yml_is_drift():
    """The negative control: a package listed beside the project, or another Python, is caught."""
    environment, project = declared()
    environment["dependencies"][-1]["pip"] = ["torch>=2.6", "-e .[dev]"]
    environment["dependencies"][0] = "python>=3.9"
    assert len(drift(environment, project)) == 2


def test_every_lower_bound_is_pinned_for_the_lowest_run():
    """Each `>=` of the dependencies and of every extra `.[dev]` pulls in becomes `==`; markers stay."""
    pins = {pin.split("==")[0]: pin for pin in map(lowest_versions.lowest, lowest_versions.requirements()) if pin}
    _, project = declared()
    assert pins["torch"] == f"torch=={next(d for d in project['dependencies'] if d.startswith('torch>=')).split('>=')[1]}"
    assert pins["lightning"].startswith("lightning==2.6")  # ">=2.6,<2.7": the lower bound
    assert pins["torchft"].startswith("torchft==0.2.0 ; platform_system")  # an extra's extra, its marker kept
    assert "tqdm" not in pins  # no bound: whatever pip picks


def test_only_a_passing_suite_is_recorded():
    """make test-lowest records pytest's closing line only when nothing failed or erred."""
    passed = "===== 2381 passed, 78 skipped, 244 warnings in 888.08s (0:14:48) ====="
    assert lowest_versions.passing_result(passed) == "2381 passed, 78 skipped, 244 warnings in 888.08s (0:14:48)"
    assert lowest_versions.passing_result(passed.replace("244 warnings", "244 warnings, 2 errors")) is None
    assert lowest_versions.passing_result(passed.replace("2381 passed", "1 failed, 2380 passed")) is None
