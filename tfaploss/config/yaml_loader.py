"""Reading run configurations: ``yaml.safe_load`` with bounds and strict mappings.

Refused, beyond safe_load: alias bombs (:class:`BoundedSafeLoader` counts the values the
document expands to, past ``max_nodes``, and a recursive alias); duplicate keys (naming
both lines; merge keys ``<<:`` still override); huge or deeply nested files
(``MAX_CONFIG_BYTES``, the recursion limit) and integers past ``MAX_INT_DIGITS``.
Cost: linear in the size of the file.
"""

from __future__ import annotations

import yaml

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_NODES", "MAX_INT_DIGITS", "BoundedSafeLoader",
           "YAMLLimitError", "load_yaml_text"]

# A full recipe has a few hundred values; these leave a wide margin.
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_BYTES = 1 << 20
# Wider than any integer a run can use (2**64 has 20 digits); bounds per key are the
# schema's (tfaploss.config.schema), this only keeps the conversion cheap and total.
MAX_INT_DIGITS = 30

_MERGE_TAG = "tag:yaml.org,2002:merge"


class YAMLLimitError(yaml.YAMLError):
    """A YAML document that expands past the configured bounds."""


def expanded_size(root: yaml.Node, limit: int) -> int:
    """Number of nodes ``root`` expands to with every alias copied out, up to ``limit``.

    Raises :class:`YAMLLimitError` past ``limit`` or on a node that contains itself.
    Iterative and memoised per node: linear in the number of distinct nodes.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes and not children_done:
            continue
        children = _children(node)
        if not children_done:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            # A child still on the path is an ancestor: the one check a cycle needs.
            for c in children:
                if id(c) in on_path:
                    raise YAMLLimitError(_where(c, "a recursive alias (a value that "
                                                   "contains itself) is not allowed in a "
                                                   "config"))
            continue
        on_path.discard(key)
        size = 1 + sum(sizes[id(c)] for c in children)
        if size > limit:
            raise YAMLLimitError(_where(
                node, f"this value expands to more than {limit} values through YAML "
                "aliases (*name); a run configuration never needs that many (an alias "
                "bomb?). Write the values out or use fewer nested aliases"))
        sizes[key] = size
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _where(node: yaml.Node, message: str) -> str:
    mark = node.start_mark
    return f"{message} (line {mark.line + 1}, column {mark.column + 1})" if mark else message


class BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that bounds alias expansion and refuses duplicate keys."""

    max_nodes = MAX_CONFIG_NODES

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            expanded_size(node, self.max_nodes)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: the base class reports it
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}: set on line {first} and again "
                        f"on line {line}; keep one", key_node.start_mark)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise YAMLLimitError(_where(
                node, f"an integer of {digits} digits; no setting of a run takes more "
                f"than {MAX_INT_DIGITS}"))
        return super().construct_yaml_int(node)


BoundedSafeLoader.add_constructor("tag:yaml.org,2002:int", BoundedSafeLoader.construct_yaml_int)


def load_yaml_text(text: str, *, name: str | None = None,
                   max_nodes: int = MAX_CONFIG_NODES):
    """``yaml.safe_load(text)`` with the bounds of :class:`BoundedSafeLoader`; ``name``
    (a file name) is shown in the error marks."""
    loader_cls = BoundedSafeLoader
    if max_nodes != BoundedSafeLoader.max_nodes:
        loader_cls = type("BoundedSafeLoader", (BoundedSafeLoader,), {"max_nodes": max_nodes})
    loader = loader_cls(text)
    if name:
        loader.name = name
    try:
        return loader.get_single_data()
    except RecursionError:
        raise YAMLLimitError("the YAML is nested too deeply to be a run configuration") \
            from None
    finally:
        loader.dispose()
