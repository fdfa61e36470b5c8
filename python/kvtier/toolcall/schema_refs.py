"""``$ref`` handling of the Kimi tool-schema subset: pointer resolution, the nesting a reference
adds, expansion of reference chains, and the check that recursion reached through required
properties can terminate (see :mod:`kvtier.toolcall.schema`).

The functions take the validator's walk state ``w`` (``w.root``, ``w.fail(message, path)``,
``w.join(path, *parts)``).
"""

from __future__ import annotations

ANNOTATIONS = frozenset({"description", "title"})


def types_of(schema: dict) -> list[str] | None:
    """The types ``schema["type"]`` names (a list), or None when it is missing or malformed."""
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return list(t)
    return None


def resolve_ref(root: dict, ref: str):
    """The subschema ``ref`` (``#`` or a ``#/...`` pointer) names in ``root``, or None."""
    if ref == "#":
        return root
    node = root
    for part in ref[2:].split("/"):
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None
    return node


def def_depths(root: dict) -> dict[str, int]:
    """``properties`` nesting below each ``$defs`` entry (and its properties and branches), keyed by
    ``#/$defs/...`` pointer; a ``$ref`` into a definition adds this depth where it is used."""
    depths: dict[str, int] = {}

    def visit(s: dict, key: str, seen: set) -> int:
        if not s:
            return 0
        depths[key] = 0
        deepest = 0
        ref = s.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            seen.add(ref)
            target = resolve_ref(root, ref)
            if target is not None:
                deepest = visit(target, ref, seen)
        if isinstance(s.get("properties"), dict):
            sub = [
                1 + visit(p, f"{key}/properties/{n}", set(seen))
                for n, p in s["properties"].items()
                if isinstance(p, dict)
            ]
            deepest = max(deepest, max(sub, default=1))
        for i, b in enumerate(
            s.get("anyOf") if isinstance(s.get("anyOf"), list) else []
        ):
            if isinstance(b, dict):
                deepest = max(deepest, visit(b, f"{key}/anyOf/{i}", set(seen)))
        if isinstance(s.get("additionalProperties"), dict):
            deepest = max(
                deepest,
                visit(
                    s["additionalProperties"], f"{key}/additionalProperties", set(seen)
                ),
            )
        depths[key] = deepest
        return deepest

    defs = root.get("$defs")
    for name, d in defs.items() if isinstance(defs, dict) else []:
        if isinstance(d, dict):
            visit(d, f"#/$defs/{name}", set())
    return depths


def terminates(w, s: dict, seen: set) -> bool:
    """Whether some finite instance of ``s`` exists following only required properties and refs
    not yet on the current chain (``seen``)."""
    types = types_of(s) or []
    if any(t not in ("object", "array") for t in types):
        return True
    kind = types[-1] if types else None
    if kind == "array":
        items = s.get("items")
        if not items or terminates(w, items, seen):
            return True
    if kind == "object":
        required, props = s.get("required"), s.get("properties")
        if not required or not props:
            return True
        if any(terminates(w, p, seen) for n, p in props.items() if n in required):
            return True
    if isinstance(s.get("anyOf"), list):
        merged = set()
        for branch in s["anyOf"]:
            branch_seen = set(seen)
            if terminates(w, branch, branch_seen):
                seen |= branch_seen
                return True
            merged |= branch_seen
        seen |= merged
    ref = s.get("$ref")
    if isinstance(ref, str):
        if ref in seen:
            return False
        seen.add(ref)
        return terminates(w, resolve_ref(w.root, ref), seen)
    return not s


def expand_ref(w, s: dict, path: str) -> dict:
    """Follow a chain of ``$ref``-only schemas (annotations allowed) to the first schema with content."""
    ref = s["$ref"]
    seen = {ref}
    target = dict(resolve_ref(w.root, ref))
    kept: dict = {}
    while isinstance(target.get("$ref"), str) and set(target) <= ANNOTATIONS | {"$ref"}:
        nxt = target["$ref"]
        if nxt in seen:
            break
        seen.add(nxt)
        for k in ANNOTATIONS & set(target):
            if k in kept:
                w.fail(
                    f"conflicting keywords found after $ref expansion: keyword {k!r} appears at multiple "
                    "levels in a chained $ref",
                    path,
                )
            kept[k] = target[k]
        target = dict(resolve_ref(w.root, nxt))
    return {**target, **kept}


def check_ref_use(w, s: dict, target: dict, path: str) -> None:
    """Keywords beside a ``$ref`` must not clash with the referenced schema."""
    mine = set(s) - {"$ref"}
    both = sorted(mine & set(target))
    if both:
        w.fail(
            f"conflicting keywords found after $ref expansion: keywords ({', '.join(both)}) are defined both "
            "alongside $ref and in the referenced schema",
            path,
        )
    if ("type" in s and "anyOf" in target) or ("type" in target and "anyOf" in s):
        w.fail(
            "invalid schema after $ref expansion: when using anyOf, type should be defined in anyOf items "
            "instead of the parent schema",
            path,
        )
    for branch in target.get("anyOf") if isinstance(target.get("anyOf"), list) else []:
        clash = sorted((mine - {"anyOf"}) & set(branch))
        if clash:
            w.fail(
                f"conflicting keywords found in anyOf after $ref expansion: keywords ({', '.join(clash)})",
                path,
            )


def check_recursion(w, s: dict, path: str, check: bool) -> None:
    """Every ``$ref`` outside ``$defs`` must be expandable without conflicts and, where instances
    must contain it (``check``), able to terminate."""
    if "$ref" in s:
        target = expand_ref(w, s, path)
        check_ref_use(w, s, target, path)
        if check and not terminates(w, target, set()):
            w.fail("detected infinite recursion without termination condition", path)
    for key, value in s.items():
        if key == "$defs":
            continue
        sub = w.join(path, key)
        if isinstance(value, dict):
            child_check = (
                check
                and key != "additionalProperties"
                and not (key == "properties" and s.get("required") == [])
            )
            check_recursion(w, value, sub, child_check)
        elif key == "anyOf" and isinstance(value, list):
            for i, branch in enumerate(value):
                if isinstance(branch, dict):
                    check_recursion(w, branch, f"{sub}[{i}]", check)
