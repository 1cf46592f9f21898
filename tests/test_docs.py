"""The README against the code it describes: what a newcomer reads first must not send them wrong
(the README's commands are run in tests/test_files.py and tests/test_plan.py)."""

import re

from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def test_the_module_table_names_every_module():
    """The Layout table's rows name sfttrain's modules (`sfttrain/x.py`, then `y.py` beside it in the
    same folder): every module is in it, and every name in it is a module."""
    table = README.split("\n## Layout\n")[1].split("\n\n")[0]
    named = set()
    for row in table.splitlines()[2:]:
        folder = None
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            folder, _, file = name.rpartition("/") if "/" in name else (folder, "/", name)
            named.add(f"{folder}/{file}")
    modules = {str(p.relative_to(REPO)) for p in (REPO / "sfttrain").rglob("*.py") if p.name != "__init__.py"}
    assert "sfttrain/trainer.py" in named and "sfttrain/data/pack.py" in named  # the table was read
    assert not modules - named, f"modules the README's Layout table does not name: {sorted(modules - named)}"
    assert not named - modules, f"names in the README's Layout table that are no module: {sorted(named - modules)}"
