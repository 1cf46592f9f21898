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


def test_every_key_the_readme_names_is_one_the_config_takes():
    """A key in the README (`data.x`, `model.x.y`, ...; a section with `.*`) is one of the schema's, a
    verl spelling it maps, or a verl key it ignores: written as it reads, it loads or is ignored, and is
    not an unknown key."""
    from omegaconf import OmegaConf

    from sfttrain.config import ALIASES, CHECKPOINT_KEYS, IGNORED_VERL_KEYS, NULL_ONLY_VERL_KEYS, Config, _flat_keys

    keys = {*_flat_keys(OmegaConf.structured(Config)), *ALIASES, *IGNORED_VERL_KEYS, *NULL_ONLY_VERL_KEYS,
            *CHECKPOINT_KEYS}
    sections = {key.rpartition(".")[0] for key in keys}
    named = set(re.findall(r"`\+?((?:[a-z_]+\.)*[a-z_]+)(?:=[^`]*)?`", README)) - {"python", "torchrun"}
    dotted = {n for n in named if n.split(".")[0] in ("data", "model", "optim", "trainer")}
    starred = set(re.findall(r"`((?:[a-z_]+\.)*[a-z_]+)\.\*`", README))
    assert {"data.train_batch_size", "model.fsdp_config.sharding_strategy"} <= dotted and starred  # the README was read
    unknown = sorted(n for n in dotted if n not in keys and n not in sections)
    assert not unknown, f"keys in the README that the config does not take: {unknown}"
    assert starred <= sections, f"sections in the README that the config does not have: {sorted(starred - sections)}"
    verl_keys = {n for n in named if n in ("use_shm", "fsdp_config", "custom_cls", "image_key", "external_lib")}
    assert not verl_keys, f"verl keys in the README without their section (a key without it is unknown): {verl_keys}"
