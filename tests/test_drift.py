"""Scripts copied from a template keep its skeleton: what a copy's ``parse_args`` and ``main`` do differently from its
template's is recorded (``tests/drift/<script>.diff``), and a statement of the shared skeleton that changes in one of
them but not in the others fails here.

A copy names its template in its second line, ``# Copied from examples/<template>``. The statements are compared as
Python sees them (`skeleton`: each statement of the two functions unparsed, comments and layout aside), with the
family module the script names (``from training_utils.families import flux2``) read as ``FAMILY`` and its pipeline
classes as ``PIPELINE``: the transformer DreamBooth scripts' loops are the same statements.

    python tests/test_drift.py            # each copy's statements that differ from its template's
    python tests/test_drift.py --record   # record them as they are now (after a deliberate change)
"""

import ast
import difflib
import re
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECORDS = Path(__file__).resolve().parent / "drift"
COPIED_FROM = re.compile(r"^# Copied from examples/(\S+\.py)")
FUNCTIONS = ("parse_args", "main")
COMPOUND = (ast.For, ast.While, ast.If, ast.With, ast.FunctionDef)


def scripts():
    return sorted(path.relative_to(EXAMPLES).as_posix() for path in EXAMPLES.rglob("*.py"))


def template_of(script):
    """The script that ``script`` names as its template, or None for a template."""
    second_line = (EXAMPLES / script).read_text().splitlines()[1]
    match = COPIED_FROM.match(second_line)
    return match.group(1) if match else None


def skeleton(script):
    """The statements of ``script``'s `FUNCTIONS`, one per line, indented by nesting (a compound statement's header,
    then its body), its family module named ``FAMILY`` and its pipeline classes ``PIPELINE``."""
    tree = ast.parse((EXAMPLES / script).read_text())
    renames = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "training_utils.families":
            renames.update({rf"\b{alias.name}\.": "FAMILY." for alias in node.names})
        if isinstance(node, ast.ImportFrom) and node.module == "diffusers":
            renames.update({rf"\b{alias.name}\b": "PIPELINE" for alias in node.names
                            if alias.name.endswith("Pipeline")})

    def normalized(text):
        for pattern, name in renames.items():
            text = re.sub(pattern, name, text)
        return text

    def statements(body, depth):
        for statement in body:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # a docstring
            if isinstance(statement, COMPOUND):
                header = next(line for line in ast.unparse(statement).splitlines() if not line.startswith("@"))
                yield "    " * depth + normalized(header)
                yield from statements(statement.body, depth + 1)
                if getattr(statement, "orelse", None):
                    yield "    " * depth + "else:"
                    yield from statements(statement.orelse, depth + 1)
            else:
                yield "    " * depth + normalized(ast.unparse(statement))

    lines = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            lines += [f"def {node.name}:", *statements(node.body, 1)]
    return lines


def drift(script):
    """The lines of `skeleton` where ``script`` differs from its template: "- " a template's statement it does not
    have, "+ " one of its own."""
    return [line for line in difflib.unified_diff(skeleton(template_of(script)), skeleton(script), lineterm="", n=0)
            if not line.startswith(("---", "+++", "@@"))]


def record_of(script):
    return RECORDS / f"{Path(script).stem}.diff"


COPIES = [script for script in scripts() if template_of(script)]


def test_every_copy_names_a_template_that_is_a_script_here():
    assert COPIES, "no script names a template"
    for script in COPIES:
        assert template_of(script) in scripts(), f"{script} names {template_of(script)}, which is no script here"
    assert {record.name for record in RECORDS.glob("*.diff")} == {record_of(script).name for script in COPIES}


@pytest.mark.parametrize("script", COPIES)
def test_a_copy_differs_from_its_template_only_where_recorded(script):
    recorded, now = record_of(script).read_text().splitlines(), drift(script)
    changed = list(difflib.unified_diff(recorded, now, "recorded", "now", lineterm="", n=0))
    assert not changed, (
        f"{script} and its template {template_of(script)} differ otherwise than recorded in {record_of(script)}:\n"
        + "\n".join(changed) + "\nA statement they share changed in one of them: change it in the template and "
        "every copy alike; or, where the difference is this family's own, record it: python tests/test_drift.py "
        "--record")


def test_the_skeleton_reads_the_family_module_and_pipeline_as_placeholders():
    lines = skeleton("dreambooth/train_dreambooth_lora_z_image.py")
    assert "            latents = FAMILY.normalized_latents(pipe, frozen.latents(batch['images']))" in lines
    assert "    pipe = load_pipeline(PIPELINE, args, weight_dtype, quantization=quantization)" in lines
    assert not any("z_image." in line or "ZImagePipeline" in line for line in lines)


if __name__ == "__main__":
    for copy in COPIES:
        if "--record" in sys.argv[1:]:
            record_of(copy).parent.mkdir(exist_ok=True)
            record_of(copy).write_text("".join(f"{line}\n" for line in drift(copy)))
            print(f"recorded {record_of(copy)}")
        else:
            print(f"== {copy} (from {template_of(copy)})", *drift(copy), sep="\n")
