"""Workflows in the frontend's UI format <-> the API format the executor runs.

Widget values in the UI format are positional: the node's widget inputs in ``input_order``,
with one extra value (``fixed``/``randomize``/...) after every widget that has
``control_after_generate``. A widget input may also be linked (``inputs[i].widget``); its
value then comes from the link. Node info is the ``/object_info`` entry of each class.
"""

from __future__ import annotations

from typing import Any

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def local_node_info(class_type: str) -> dict:
    """``/object_info`` of one class from the in-process host (V3 and V1 nodes)."""
    import nodes

    cls = nodes.NODE_CLASS_MAPPINGS[class_type]
    if hasattr(cls, "GET_NODE_INFO_V1"):
        return cls.GET_NODE_INFO_V1()
    inputs = cls.INPUT_TYPES()
    return {
        "input": inputs,
        "input_order": {cat: list(values) for cat, values in inputs.items()},
        "output": list(cls.RETURN_TYPES),
        "output_name": list(getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES),
    }


def _spec(info: dict, name: str) -> tuple[Any, dict]:
    for category in ("required", "optional"):
        entry = info["input"].get(category, {}).get(name)
        if entry is not None:
            return entry[0], (entry[1] if len(entry) > 1 else {})
    raise KeyError(name)


def widgets(info: dict) -> list[tuple[str, bool]]:
    """(name, has_control_value) of each widget input, in the order of widgets_values."""
    names = []
    for category in ("required", "optional"):
        for name in info.get("input_order", {}).get(category, []):
            kind, options = _spec(info, name)
            if isinstance(kind, list) or kind in WIDGET_TYPES:
                control = bool(options.get("control_after_generate"))
                names.append((name, control))
    return names


def ui_to_api(workflow: dict, infos: dict[str, dict]) -> dict:
    links = {link[0]: link for link in workflow["links"]}
    prompt: dict[str, dict] = {}
    for node in workflow["nodes"]:
        if node.get("mode", 0) != 0:
            continue
        info = infos[node["type"]]
        inputs: dict[str, Any] = {}
        linked = set()
        for socket in node.get("inputs", []):
            if socket.get("link") is not None:
                _id, from_node, from_slot, _to, _slot, _type = links[socket["link"]]
                inputs[socket["name"]] = [str(from_node), from_slot]
                linked.add(socket["name"])
        values = list(node.get("widgets_values", []))
        position = 0
        for name, control in widgets(info):
            if position < len(values) and name not in linked:
                inputs[name] = values[position]
            position += 2 if control else 1
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def api_to_ui(prompt: dict, infos: dict[str, dict], positions: dict[str, tuple[int, int]] | None = None) -> dict:
    """A UI-format workflow for an API prompt (numeric node ids), laid out by ``positions``."""
    nodes, links = [], []
    outputs: dict[tuple[str, int], list[int]] = {}
    link_id = 0
    for node_id, node in prompt.items():
        info = infos[node["class_type"]]
        sockets = []
        widget_names = {name for name, _ in widgets(info)}
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                link_id += 1
                kind, _ = _spec(info, name)
                kind = "COMBO" if isinstance(kind, list) else kind
                links.append([link_id, int(value[0]), value[1], int(node_id), len(sockets), kind])
                outputs.setdefault((value[0], value[1]), []).append(link_id)
                socket = {"name": name, "type": kind, "link": link_id}
                if name in widget_names:
                    socket["widget"] = {"name": name}
                sockets.append(socket)
        values = []
        for name, control in widgets(info):
            value = node["inputs"].get(name)
            if isinstance(value, list):  # linked widget: keep a placeholder
                value = ""
            values.append(value)
            if control:
                values.append("fixed")
        nodes.append(
            {
                "id": int(node_id),
                "type": node["class_type"],
                "pos": list((positions or {}).get(node_id, (100 * int(node_id), 100))),
                "size": [320, 120],
                "flags": {},
                "order": len(nodes),
                "mode": 0,
                "inputs": sockets,
                "outputs": [],
                "properties": {"Node name for S&R": node["class_type"]},
                "widgets_values": values,
            }
        )
        if "title" in node:
            nodes[-1]["title"] = node["title"]
    for entry in nodes:
        info = infos[entry["type"]]
        names = info.get("output_name") or info["output"]
        entry["outputs"] = [
            {"name": names[slot], "type": kind, "links": outputs.get((str(entry["id"]), slot), []), "slot_index": slot}
            for slot, kind in enumerate(info["output"])
        ]
    return {
        "last_node_id": max(n["id"] for n in nodes),
        "last_link_id": link_id,
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {},
        "version": 0.4,
    }
