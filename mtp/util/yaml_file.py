"""Reading a YAML file of settings strictly: a syntax error or a key given twice names its line."""

from __future__ import annotations

import os
from pathlib import Path

from mtp.util.errors import InputError

__all__ = ["read_yaml_mapping"]


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

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InputError(f"{what}: cannot read {path} ({err.strerror})") from None
    loader = _strict_loader()(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise InputError(f"{what}: not valid YAML:{where} {problem}") from None
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
