"""Reading a YAML file of settings strictly: a syntax error or a key given twice names its line,
and a document whose aliases expand it beyond `MAX_VALUES` values (a "billion laughs": nine
levels of ten aliases make 10**9 values of a few hundred bytes) is refused before anything
expands it."""

from __future__ import annotations

import os
from pathlib import Path

from mtp.util.errors import InputError
from mtp.util.paths import not_a_file

__all__ = ["MAX_BYTES", "MAX_VALUES", "check_yaml_text", "read_yaml_mapping"]

#: Values (scalars, lists and mappings) a document of settings may hold once its aliases are
#: expanded: a config spells out some hundreds, a thousand-head list of weights a thousand. Who
#: reads the settings afterwards (LightningCLI, jsonargparse) expands and copies them.
MAX_VALUES = 100_000
#: The largest settings file read; configs are a few KB.
MAX_BYTES = 16 << 20


def _expanded_values(root) -> int | None:
    """The values a composed YAML node stands for once its aliases are expanded (a node that
    an alias repeats counts each time), or None if that exceeds `MAX_VALUES` or a node holds
    itself. Counted from the composed graph, each node once, so a billion laughs costs
    microseconds."""
    import yaml

    sizes: dict[int, int] = {}
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes and not children_done:
            if sizes[id(node)] < 0:  # still being counted: an alias inside its own anchor
                return None
            continue
        children = [] if isinstance(node, yaml.ScalarNode) else \
            [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) \
            else list(node.value)
        if not children_done:
            sizes[id(node)] = -1
            stack.append((node, True))
            stack.extend((child, False) for child in children)
            continue
        sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
        if sizes[id(node)] > MAX_VALUES:
            return None
    return sizes[id(root)]


def check_yaml_text(text: str, what: str) -> None:
    """Refuse YAML `text` whose aliases expand it past `MAX_VALUES` values (or into itself),
    naming `what` (a file or a flag); nothing else is checked. For values given on a command
    line, which LightningCLI reads as YAML too, and takes as a plain string where it is not
    YAML."""
    import yaml

    if "*" not in text or "&" not in text:  # no alias, no anchor: nothing to expand
        return
    try:
        _node, loader = _compose(text, what, syntax_errors=False)
    except (yaml.YAMLError, RecursionError):  # not YAML: a plain string to LightningCLI too
        return
    loader.dispose()


def _not_yaml(err, what: str) -> InputError:
    """A YAML syntax error as a user's error, with its line and column."""
    mark = getattr(err, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
    problem = getattr(err, "problem", None) or str(err)
    return InputError(f"{what}: not valid YAML:{where} {problem}")


def _compose(text: str, what: str, *, syntax_errors: bool = True):
    """The composed node of YAML `text` with a loader that records repeated keys, refusing a
    document that expands past `MAX_VALUES`; (node, loader), the loader to be disposed. A
    syntax error is an `InputError` naming `what`, or with `syntax_errors` False yaml's own."""
    import yaml

    loader = _strict_loader()(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as err:
        loader.dispose()
        if not syntax_errors:
            raise
        raise _not_yaml(err, what) from None
    except RecursionError:
        loader.dispose()
        if not syntax_errors:
            raise
        raise InputError(f"{what}: nested too deeply to be settings") from None
    if node is not None and _expanded_values(node) is None:
        loader.dispose()
        raise InputError(f"{what}: its aliases expand it to more than {MAX_VALUES:,} values "
                         f"(or into itself): a document that grows when read (a 'billion "
                         f"laughs') is refused")
    return node, loader


def _strict_loader():
    """A yaml SafeLoader class that records each key repeated within one mapping (merge keys
    `<<` aside, which may be overridden) instead of keeping the last silently."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def __init__(self, stream) -> None:
            super().__init__(stream)
            self.duplicates: list[tuple[int, str]] = []  # (line, key and first line)

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                first: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        seen = first.get(key)
                    except TypeError:  # an unhashable key: the constructor's own error
                        continue
                    if seen is None:
                        first[key] = line
                    else:
                        self.duplicates.append((line, f"key {key!r} again (first on line "
                                                      f"{seen})"))
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def read_yaml_mapping(path: str | os.PathLike, what: str) -> dict:
    """The YAML file at `path`, which must hold a mapping; `what` names it in errors (the flag,
    e.g. `--config x.yaml`), with the line of a syntax error or of each duplicated key."""
    import yaml

    problem = not_a_file(path)
    if problem not in (None, "does not exist"):  # a pipe would block, a device never end
        raise InputError(f"{what}: {path} {problem}")
    size = os.path.getsize(path) if problem is None else 0
    if size > MAX_BYTES:
        raise InputError(f"{what}: {size:,} bytes, more than a settings file holds "
                         f"({MAX_BYTES:,} at most)")
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{what}: cannot read {path} "
                         f"({getattr(err, 'strerror', None) or err})") from None
    node, loader = _compose(text, what)
    try:
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as err:
        raise _not_yaml(err, what) from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise InputError(f"{what}: duplicate keys (YAML would keep only the last, silently):"
                         + "".join(f"\n  line {line}: {text}"
                                   for line, text in sorted(loader.duplicates)))
    if not isinstance(data, dict):
        raise InputError(f"{what}: must be a YAML mapping of settings (it holds a "
                         f"{type(data).__name__})")
    return data
