"""The README and docs/ against the code they describe: what a newcomer reads first must not send them
wrong (the README's data commands are run in tests/test_files.py, its preflight in tests/test_plan.py)."""

import re
import shlex
import subprocess

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((REPO / "docs").glob("*.md"))}
DESIGN = DOCS["design.md"]


def test_the_module_table_names_every_module():
    """docs/design.md's Layout table rows name sfttrain's modules (`sfttrain/x.py`, then `y.py` beside
    it in the same folder): every module is in it, and every name in it is a module."""
    table = DESIGN.split("\n## Layout\n")[1].split("\n\n")[0]
    named = set()
    for row in table.splitlines()[2:]:
        folder = None
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            folder, _, file = name.rpartition("/") if "/" in name else (folder, "/", name)
            named.add(f"{folder}/{file}")
    modules = {str(p.relative_to(REPO)) for p in (REPO / "sfttrain").rglob("*.py") if p.name != "__init__.py"}
    assert "sfttrain/trainer.py" in named and "sfttrain/data/pack.py" in named  # the table was read
    assert not modules - named, f"modules the Layout table does not name: {sorted(modules - named)}"
    assert not named - modules, f"names in the Layout table that are no module: {sorted(named - modules)}"


def test_every_key_the_docs_name_is_one_the_config_takes():
    """A key in the README or docs/ (`data.x`, `model.x.y`, ...; a section with `.*`) is one of the
    schema's, a verl spelling it maps, or a verl key it ignores: written as it reads, it loads or is
    ignored, and is not an unknown key."""
    from omegaconf import OmegaConf

    from sfttrain.config import ALIASES, CHECKPOINT_KEYS, IGNORED_VERL_KEYS, NULL_ONLY_VERL_KEYS, Config, _flat_keys

    keys = {*_flat_keys(OmegaConf.structured(Config)), *ALIASES, *IGNORED_VERL_KEYS, *NULL_ONLY_VERL_KEYS,
            *CHECKPOINT_KEYS}
    sections = {key.rpartition(".")[0] for key in keys}
    for name, text in {"README.md": README, "verl.md": DOCS["verl.md"], "design.md": DESIGN}.items():
        named = set(re.findall(r"`\+?((?:[a-z_]+\.)*[a-z_]+)(?:=[^`]*)?`", text)) - {"python", "torchrun"}
        dotted = {n for n in named if n.split(".")[0] in ("data", "model", "optim", "trainer")}
        starred = set(re.findall(r"`((?:[a-z_]+\.)*[a-z_]+)\.\*`", text))
        assert "data.train_batch_size" in dotted or name == "design.md", name  # the text was read
        unknown = sorted(n for n in dotted if n not in keys and n not in sections)
        assert not unknown, f"keys in {name} that the config does not take: {unknown}"
        assert starred <= sections, f"sections in {name} that the config does not have: {sorted(starred - sections)}"
        verl_keys = {n for n in named if n in ("use_shm", "fsdp_config", "custom_cls", "image_key", "external_lib")}
        assert not verl_keys, f"verl keys in {name} without their section (a key without it is unknown): {verl_keys}"


def bash_commands(text: str) -> list[list[str]]:
    """The commands of a markdown text's ```bash blocks (continuation lines joined), as argument lists."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_every_path_and_target_the_commands_name_exists():
    """A recipe, script, example file or make target in the README's or docs/' commands is one the
    checkout has: a renamed recipe must not leave a command that fails on its first argument."""
    commands = [c for text in (README, *DOCS.values()) for c in bash_commands(text)]
    assert ["make", "demo"] in commands  # the blocks were read
    targets = set(re.findall(r"^([a-z]+):", (REPO / "Makefile").read_text(), re.M))
    missing = [c[1] for c in commands if c[0] == "make" and c[1] not in targets]
    for command in commands:
        for arg in command:
            value = arg.partition("=")[2] if "=" in arg else arg
            if re.match(r"(recipes|slurm|examples|data_prep|assets)/", value) and not (REPO / value).exists():
                missing.append(value)
    assert not missing, f"paths or make targets in the docs' commands that the checkout lacks: {missing}"


def test_the_readme_starts_with_the_two_commands_ci_runs():
    """.ci/run runs the README's first two commands in its order, as a newcomer does: `make demo`, then
    `make test`; the README is for users and stays short (the rest is in docs/)."""
    first = bash_commands(README)[:2]
    ci = [line.split() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert first == ci == [["make", "demo"], ["make", "test"]], (first, ci)
    assert len(README.splitlines()) <= 350


def test_no_work_history_in_the_docs():
    """The project speaks of itself, not of how it was made: no numbered work periods ("the
    thirty-seventh session", "session 30") in the README or docs/; benchmarks.md's sections are dated."""
    ordinal = r"(?:\w+-)?(?:first|second|third|\w+th|\d+(?:st|nd|rd|th))"
    period = re.compile(rf"\b(?:{ordinal}\s+session|sessions?\s+\d+)", re.I)
    for name, text in {"README.md": README, **DOCS}.items():
        found = sorted(set(m.group(0) for m in period.finditer(text)))
        assert not found, f"{name} numbers work periods: {found}"
    headings = re.findall(r"^## (.*)$", DOCS["benchmarks.md"], re.M)
    undated = [h for h in headings if not re.match(r"\d{4}-\d{2}-\d{2}(/\d{2})?: ", h)]
    assert headings and not undated, f"benchmarks.md sections without a date: {undated}"


def test_the_readme_says_flash_attn_is_untested():
    """No test or benchmark has run the flash_attn backend: the README says so and names the tested path
    wherever it offers the package, and `auto`'s preference, which the README warns of, is still so."""
    from sfttrain.attention import BACKENDS

    assert "The `flash_attn` attention backend is untested" in README
    assert "`model.attn_implementation=torch_varlen`" in README and "**Untested**" in DESIGN
    assert BACKENDS[0] == "flash_attn", "auto no longer prefers flash_attn: update the README's warning"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_lands():
    """A relative link in the README or docs/ (`[x](docs/design.md#data)`) names a file of the checkout
    and, where it has one, a heading of that file: a section renamed must not leave a dead link."""
    dead = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M) if linked.is_file() else []
            if not linked.exists() or (anchor and anchor not in map(slug, headings)):
                dead.append(f"{path.name}: {target}")
    assert not dead, f"links that land nowhere: {dead}"


def test_the_first_runs_batch_arithmetic_is_what_the_demo_prints(gsm8k_dir, tmp_path):
    """The README's "First run" shows the lines rank 0 prints for `make demo`: the preflight of the demo's
    recipe on the demo's data (the same lines, from the same code) prints them as shown."""
    import contextlib
    import io

    from sfttrain.plan import main

    shown = README.split("Rank 0 prints the batch arithmetic before any compute:\n\n```\n")[1].split("```")[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(REPO / "recipes" / "demo_cpu.yaml"), f"data.train_files={gsm8k_dir / 'train.parquet'}",
                     f"data.val_files={gsm8k_dir / 'test.parquet'}", f"trainer.default_local_dir={tmp_path / 'run'}",
                     f"model.partial_pretrain={REPO / 'assets' / 'models' / 'stories260K'}", "--nproc", "2"])
    assert code == 0 and shown in out.getvalue(), out.getvalue()


def test_make_clean_says_what_it_removes(tmp_path):
    """`make clean` deletes the virtualenv too: it says so, naming both folders, before it removes them."""
    venv, work = tmp_path / "venv", tmp_path / "work"
    venv.mkdir(), work.mkdir()
    done = subprocess.run(["make", "-s", "clean", f"VENV={venv}", f"WORK={work}"], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert f"removing {venv} (the installed environment" in done.stdout and f"and {work} (the demo's" in done.stdout
    assert not venv.exists() and not work.exists()
