"""Every node the pack registers has a help page, and every input has a tooltip.

ComfyUI's frontend (comfyui_frontend_package 1.35.9, the one ComfyUI 0.8.0 pins) shows a
custom node's help page from ``/extensions/<pack folder>/docs/<node id>/<locale>.md``, then
``/extensions/<pack folder>/docs/<node id>.md``; ``/extensions/<pack folder>/`` is the pack's
WEB_DIRECTORY. So the pages live in ``<WEB_DIRECTORY>/docs/<node id>.md``. Without one the
help panel falls back to the node's one-line description.

A page names each input (by its id) in its "Inputs" section and each output (by its display
name) in its "Outputs" section as inline code, e.g. ``- `steps` ...``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hostenv import PACK_NAME, PACK_NODE_IDS, PACK_ROOT

pytestmark = pytest.mark.host



def docs_folder() -> Path:
    import lowvram_lora

    return (PACK_ROOT / lowvram_lora.WEB_DIRECTORY / "docs").resolve()


@pytest.fixture(scope="module")
def pack_nodes(comfy) -> dict[str, type]:
    """node id -> class, for every node of this pack in the host's registry."""
    import nodes

    found = {
        node_id: comfy.node_class(node_id)
        for node_id, cls in nodes.NODE_CLASS_MAPPINGS.items()
        if getattr(cls, "__module__", "").split(".")[0] == PACK_NAME
    }
    missing = set(PACK_NODE_IDS) - set(found)
    assert not missing, f"the pack no longer registers {sorted(missing)}"
    return found


def sections(markdown: str) -> dict[str, str]:
    """``## Heading`` (lower-cased) -> the text under it, up to the next ``## `` heading."""
    out: dict[str, str] = {}
    current = None
    for line in markdown.splitlines():
        heading = re.match(r"^##\s+(.+?)\s*$", line)
        if heading:
            current = heading.group(1).lower()
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def code_names(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


def page_problems(node_id: str, cls: type) -> list[str]:
    schema = cls.GET_SCHEMA()
    path = docs_folder() / f"{node_id}.md"
    if not path.is_file():
        return [f"{node_id}: no help page at {path}"]
    text = path.read_text(encoding="utf-8")
    problems = []
    title = text.lstrip().splitlines()[0] if text.strip() else ""
    if not title.startswith("# ") or schema.display_name not in title:
        problems.append(f"{node_id}: the page's first line should be '# {schema.display_name}', got {title!r}")
    parts = sections(text)
    if "inputs" not in parts:
        problems.append(f"{node_id}: the page has no '## Inputs' section")
    if "outputs" not in parts:
        problems.append(f"{node_id}: the page has no '## Outputs' section")
    documented_inputs = code_names(parts.get("inputs", ""))
    for item in schema.inputs:
        if item.id not in documented_inputs:
            problems.append(f"{node_id}: input `{item.id}` is not named (as `{item.id}`) under '## Inputs'")
    documented_outputs = code_names(parts.get("outputs", ""))
    for item in schema.outputs:
        if item.display_name not in documented_outputs:
            problems.append(
                f"{node_id}: output `{item.display_name}` is not named (as `{item.display_name}`) under '## Outputs'"
            )
    return problems


def test_every_node_has_a_page_naming_its_inputs_and_outputs(pack_nodes):
    problems = [problem for node_id, cls in sorted(pack_nodes.items()) for problem in page_problems(node_id, cls)]
    assert not problems, "help pages (web/docs/<node id>.md):\n" + "\n".join(problems)


def test_every_page_belongs_to_a_node(pack_nodes):
    """A renamed or removed node must not leave a page behind that no node shows."""
    pages = {path.stem for path in docs_folder().glob("*.md")}
    orphans = sorted(pages - set(pack_nodes))
    assert not orphans, f"pages without a node of that id: {orphans}"


def inputs_without_tooltip(node_classes: dict[str, type]) -> list[str]:
    return [
        f"{node_id}: input `{item.id}`"
        for node_id, cls in sorted(node_classes.items())
        for item in cls.GET_SCHEMA().inputs
        if not (isinstance(item.tooltip, str) and item.tooltip.strip())
    ]


def test_every_input_has_a_tooltip(pack_nodes):
    missing = inputs_without_tooltip(pack_nodes)
    assert not missing, "inputs without a tooltip:\n" + "\n".join(missing)


def test_an_input_without_a_tooltip_is_reported(comfy):
    from comfy_api.latest import io

    class Probe(io.ComfyNode):
        @classmethod
        def define_schema(cls) -> io.Schema:
            return io.Schema(
                node_id="LowVRAMLoRA_DocsProbe",
                inputs=[io.Int.Input("with_tooltip", tooltip="Says what it does."), io.Int.Input("bare")],
                outputs=[io.Int.Output(display_name="out")],
            )

        @classmethod
        def execute(cls, with_tooltip: int, bare: int) -> io.NodeOutput:
            return io.NodeOutput(with_tooltip + bare)

    assert inputs_without_tooltip({"LowVRAMLoRA_DocsProbe": Probe}) == ["LowVRAMLoRA_DocsProbe: input `bare`"]


def test_a_missing_page_is_reported(pack_nodes, monkeypatch, tmp_path):
    """The page check can fail: with an empty docs folder every node is reported."""
    monkeypatch.setattr(sys.modules[__name__], "docs_folder", lambda: tmp_path)
    problems = [problem for node_id, cls in pack_nodes.items() for problem in page_problems(node_id, cls)]
    assert len(problems) == len(pack_nodes)
    assert all("no help page" in problem for problem in problems)


def test_a_page_missing_an_input_is_reported(pack_nodes, monkeypatch, tmp_path):
    node_id = "LowVRAMLoRA_SaveLoRA"
    page = (docs_folder() / f"{node_id}.md").read_text(encoding="utf-8")
    (tmp_path / f"{node_id}.md").write_text(page.replace("`filename_prefix`", "filename prefix"), encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "docs_folder", lambda: tmp_path)
    problems = page_problems(node_id, pack_nodes[node_id])
    assert any("`filename_prefix`" in problem for problem in problems), problems


def test_the_frontend_fetches_pages_where_they_are():
    """The installed frontend asks for /extensions/<pack>/docs/<node id>.md (and a per-locale page
    first): if a frontend update moves that, this fails rather than the pages silently vanishing."""
    package = pytest.importorskip("comfyui_frontend_package")
    assets = Path(package.__file__).parent / "static" / "assets"
    pattern = re.compile(r"`/extensions/\$\{\w+\}/docs/\$\{\w+\.name\}\.md`")
    bundles = [path for path in assets.glob("*.js") if pattern.search(path.read_text(encoding="utf-8", errors="replace"))]
    assert bundles, f"no bundle in {assets} fetches `/extensions/${{pack}}/docs/${{node.name}}.md`"
