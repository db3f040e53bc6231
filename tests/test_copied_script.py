"""A script copied out of the repository passes the smoke test that docs/porting.md gives its user, run
beside it with pytest, with nothing of this checkout importable but the training_utils package (as installed)."""

import os
import shutil
import sys
import textwrap

import pytest

import training_utils.testing
from helpers import EXAMPLES, REPO, run_bounded


def users_smoke_test():
    """The smoke test that docs/porting.md's "Smoke-testing a copied script" gives, for a copy of
    train_text_to_image_lora.py; `training_utils.testing`'s docstring shows the same."""
    section = (REPO / "docs" / "porting.md").read_text().split("## Smoke-testing a copied script\n", 1)[1]
    (test,) = [block.split("```", 1)[0] for block in section.split("```python\n")[1:]]
    docstring_example = training_utils.testing.__doc__.split("::\n", 1)[1].split("\n`launch_script`", 1)[0]
    assert textwrap.dedent(docstring_example).strip() == test.strip()
    return test


@pytest.mark.slow  # a pytest that launches the script
def test_a_copied_script_passes_its_users_smoke_test(tmp_path):
    project, site_packages = tmp_path / "my_project", tmp_path / "site-packages"
    project.mkdir()
    site_packages.mkdir()
    shutil.copy(EXAMPLES / "text_to_image" / "train_text_to_image_lora.py", project)
    (project / "test_train_text_to_image_lora.py").write_text(users_smoke_test())
    # This checkout's package as if installed; the editable install may point at another checkout.
    (site_packages / "training_utils").symlink_to(REPO / "training_utils")
    result = run_bounded([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"],
                         env={**os.environ, "PYTHONPATH": str(site_packages)}, cwd=project)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-5000:]
