"""JSON-schema walking and the checks that a constraint admits finite text (structured.py's).

`map_schemas` visits every subschema of a schema (schema positions only: a property named
"contains" or a keyword inside a const is data). `never_ends` and `unending_rules` say when no
finite text matches a JSON schema or a Lark grammar: llguidance admits such constraints and
then runs until its parser limit, so structured.py refuses them when a request is added. Both
checks are sound (what they cannot follow counts as able to end), not complete.
"""

from __future__ import annotations

import re

# schema keywords whose value is a subschema, a list of subschemas, or a map of names to subschemas
# (JSON Schema 2020-12 and draft 4-7); every other keyword's value (const, enum, default, examples, ...)
# is data, never walked
_ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def map_schemas(schema, visit, path: str = "#", merged: bool = False, reach: dict | None = None):
    """A copy of schema with visit(node, path, merged) applied to each of its (sub)schemas, innermost
    first. path is the node's JSON pointer; merged says the node is intersected with another schema
    that may declare other keys: an allOf branch, or an anyOf / oneOf branch whose parent lists
    properties of its own. reach (ref_targets') leads the walk through non-schema positions to the
    $ref targets there, each walked as a schema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_LISTS and isinstance(value, list):
            joined = key == "allOf" or (key in ("anyOf", "oneOf") and ("properties" in schema or "patternProperties" in schema))
            out[key] = [map_schemas(v, visit, f"{path}/{key}/{i}", joined, reach) for i, v in enumerate(value)]
        elif key in _ONE_SCHEMA and isinstance(value, dict):
            out[key] = map_schemas(value, visit, f"{path}/{key}", reach=reach)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: map_schemas(v, visit, f"{path}/{key}/{pointer(name)}", reach=reach) for name, v in value.items()}
        elif reach and f"{path}/{pointer(key)}" in reach:
            out[key] = _map_data(value, visit, f"{path}/{pointer(key)}", reach)
    return visit(out, path, merged)


def _map_data(value, visit, path: str, reach: dict):
    """value, data at path (not a schema position), with the $ref targets in it walked as schemas."""
    if reach[path]:
        return map_schemas(value, visit, path, reach=reach)
    if isinstance(value, dict):
        at = {k: f"{path}/{pointer(k)}" for k in value}
        return {k: _map_data(v, visit, at[k], reach) if at[k] in reach else v for k, v in value.items()}
    if isinstance(value, list):
        return [_map_data(v, visit, f"{path}/{i}", reach) if f"{path}/{i}" in reach else v for i, v in enumerate(value)]
    return value


def ref_targets(schema, root: str = "#", refs: "Refs | None" = None) -> dict:
    """{pointer: True} for each node a local $ref points at outside schema positions (OpenAPI's
    `#/components/schemas/Pet`; llguidance resolves a $ref as any JSON pointer into the document),
    {pointer: False} for the nodes above one: map_schemas' reach. A target's own $refs are followed.
    $refs are resolved as Refs resolves them (a nested `$id`'s pointers start at its node)."""
    if not isinstance(schema, dict) or all(_in_definitions(schema, ref) for ref in set(_all_refs(schema))):
        return {}                   # the common case (pydantic's), found without walking: no copies
    refs = refs or Refs(schema, root)
    seen, pending, reach = set(), [], {}

    def note(node, path, merged):
        seen.add(path)
        if isinstance(node.get("$ref"), str):
            pending.append(refs.target(path, node["$ref"]))
        return node

    map_schemas(schema, note, root)
    while pending:
        parts = pending.pop()
        at = _path(root, parts or ())
        if not parts or at in seen or reach.get(at):
            continue
        for i in range(len(parts)):
            reach.setdefault(_path(root, parts[:i]), False)
        reach[at] = True
        map_schemas(_at(schema, parts), note, at)
    reach.pop(root, None)
    return reach


class Refs:
    """Where the $refs of a schema point, as JSON Schema 2020-12 resolves them (and llguidance, whose
    resolver follows it): a $ref is joined with the base URI its enclosing `$id`s give it; the URI
    names the document (its root's `$id`, or none) or a subschema with an `$id` of its own; a fragment
    that is a JSON pointer is read from that node (`#/$defs/a` inside a nested `$id` is that
    resource's definition, not the root's), any other fragment is a plain name that node's resource
    declares with `$anchor` or `$dynamicAnchor` (and, in draft 6 / 7 documents, with an `$id` of
    `#name`). `$id`s and anchors count in schema positions only, as both resolvers crawl them.
    target(path, ref): the keys, from the root, of the node that the $ref at path names, or None
    (a remote or unknown URI, a name nobody declares, a pointer to nothing)."""

    def __init__(self, schema, root: str = "#"):
        self.schema, self.root = schema, root
        self.bases: dict[str, str] | None = None     # path of a resource's root -> its URI, once crawled
        self.nodes: dict[str, list[str]] = {}        # a resource's URI -> the keys of its root
        self.anchors: dict[tuple[str, str], list[str]] = {}     # (resource URI, name) -> keys
        self.nested: bool | None = None              # whether a subschema has an `$id`

    def named(self, path: str, ref: str) -> str | None:
        """target() as a path (the root's name, then the escaped keys), as map_schemas writes them."""
        parts = self.target(path, ref)
        return None if parts is None else _path(self.root, parts)

    def target(self, path: str, ref: str) -> list[str] | None:
        if ref == "#" or ref.startswith("#/"):
            if self.nested is None:
                self.nested = _has_nested_ids(self.schema)
            if self.bases is None and not self.nested:
                parts = _ref_parts(ref)             # the common case: a pointer from the root, no crawl
                return parts if parts is not None and _at(self.schema, parts) is not None else None
        if self.bases is None:
            self._crawl()
        from urllib.parse import unquote, urldefrag

        uri, fragment = urldefrag(_join(self._base(path), ref))
        keys = self.nodes.get(uri)
        if keys is None:
            return None
        if fragment.startswith("/"):
            parts = keys + [unquote(p).replace("~1", "/").replace("~0", "~") for p in fragment[1:].split("/")]
        elif fragment:
            parts = self.anchors.get((uri, unquote(fragment)))
        else:
            parts = keys
        return parts if parts is not None and _at(self.schema, parts) is not None else None

    def _base(self, path: str) -> str:
        """The URI of the innermost resource whose subtree holds path."""
        best, base = -1, self.bases.get(self.root, "")
        for at, uri in self.bases.items():
            if len(at) > best and (path == at or path.startswith(at + "/")):
                best, base = len(at), uri
        return base

    def _crawl(self) -> None:
        found = []

        def note(node, path, merged):
            found.append((path, node))
            return node

        map_schemas(self.schema, note, self.root)
        found.sort(key=lambda item: len(_keys(self.root, item[0])))          # a resource before what it holds
        legacy = isinstance(self.schema.get("$schema"), str) and re.search(r"draft-0[67]", self.schema["$schema"])
        self.bases = {self.root: _join("", self.schema["$id"]) if isinstance(self.schema.get("$id"), str) else ""}
        self.bases[self.root] = self.bases[self.root].split("#")[0]
        for path, node in found:
            ident = node.get("$id")
            if isinstance(ident, str) and path != self.root:
                uri, _, name = _join(self._base(path), ident).partition("#")
                if uri and not (legacy and ident.startswith("#")):
                    self.bases[path] = uri
                if legacy and name:
                    self.anchors.setdefault((self._base(path), name), _keys(self.root, path))
        for at, uri in sorted(self.bases.items(), key=lambda item: -len(item[0])):
            self.nodes[uri] = _keys(self.root, at)          # the outermost of two alike wins
        for path, node in found:
            for key in ("$anchor", "$dynamicAnchor"):       # a dynamic anchor is a plain name too
                if isinstance(node.get(key), str):
                    self.anchors.setdefault((self._base(path), node[key]), _keys(self.root, path))


def _join(base: str, ref: str) -> str:
    """ref resolved against base (RFC 3986; a bare fragment keeps any base, a URN's too)."""
    from urllib.parse import urljoin

    if ref.startswith("#"):
        return base.split("#")[0] + ref
    return urljoin(base, ref) if base else ref


def _has_nested_ids(schema) -> bool:
    """Whether a dict below the root has an `$id` (data included: a false alarm only costs a crawl)."""
    todo = [v for v in schema.values() if isinstance(v, (dict, list))] if isinstance(schema, dict) else []
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if "$id" in node:
                return True
            todo.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            todo.extend(v for v in node if isinstance(v, (dict, list)))
    return False


def _path(root: str, parts) -> str:
    return root + "".join(f"/{pointer(p)}" for p in parts)


def _keys(root: str, path: str) -> list[str]:
    """The keys of a path map_schemas wrote (root + escaped keys)."""
    rest = path[len(root):]
    return [p.replace("~1", "/").replace("~0", "~") for p in rest[1:].split("/")] if rest else []


def _all_refs(value):
    """Each $ref string in value, data included."""
    todo = [value]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            todo.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            todo.extend(node)


def _in_definitions(schema, ref: str) -> bool:
    """Whether ref names a schema position: a resource or an anchor (no pointer: both are declared in
    schema positions only), the root, or a definition (`#/$defs/a`)."""
    if not ref.partition("#")[2].startswith("/"):
        return True
    parts = _ref_parts(ref)
    return parts is not None and len(parts) == 2 and parts[0] in ("$defs", "definitions")


def map_document(schema, visit, root: str = "#", refs: Refs | None = None):
    """map_schemas over every node llguidance reads as a schema: the $ref targets outside schema
    positions too, so a model under OpenAPI's `components/schemas` is read as one under `$defs`."""
    return map_schemas(schema, visit, root, reach=ref_targets(schema, root, refs))


def pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def never_ends(schema) -> bool:
    """Whether no finite JSON value matches schema: the least fixpoint of "some finite value matches"
    over its local $ref targets. A node surely matches nothing when it is false, when its $ref, an
    allOf branch, every anyOf / oneOf branch, a required property of an "object" or one of the first
    minItems items of an "array" matches nothing; anything else counts as matchable. $refs resolve
    as Refs reads them (anchors and nested `$id`s included); one that names nothing counts as matchable."""
    matchable, _ = _matchability(schema)
    return matchable is not None and not matchable(schema, "#")


def without_dead_ends(schema):
    """schema with each subschema that surely matches nothing (never_ends' reading) made `false`, the
    root excepted: a property, an anyOf branch or the items of an array whose schema can only recurse
    (`{"$ref": "#/$defs/n"}` where n requires itself). The values that match are the same; what
    changes is that the grammar no longer lets a reply start such a value, which it could never
    finish (llguidance forces its text until its parser limit). A copy, or schema itself when
    nothing is dead."""
    matchable, dead_targets = _matchability(schema)
    if not dead_targets or not matchable(schema, "#"):
        return schema                       # no $ref target is dead, or nothing matches: never_ends refuses it
    memo, dead = {}, []

    def visit(node, path, merged):
        memo[path] = matchable(node, path, memo)
        if not memo[path]:
            dead.append(path)
        return node if memo[path] else False

    out = map_document(schema, visit)
    return out if dead else schema


def _matchability(schema):
    """(never_ends' test as matchable(node, path, memo=None) once its $ref targets' fixpoint is known,
    whether some target matches nothing), or (None, False) when schema has no local $ref to follow
    (llguidance finds the rest)."""
    if not isinstance(schema, dict) or next(_all_refs(schema), None) is None:
        return None, False
    refs = Refs(schema)
    targets, ref_at = {}, {}                # target's path -> its node; a $ref's own path -> its target's

    def note(node, path, merged):
        ref = node.get("$ref")
        parts = refs.target(path, ref) if isinstance(ref, str) else None
        if parts is not None:
            ref_at[path] = _path("#", parts)
            targets[ref_at[path]] = _at(schema, parts)
        return node

    map_document(schema, note, refs=refs)
    if not targets:
        return None, False
    ends = set()

    def matchable(node, path: str, memo: dict | None = None) -> bool:
        if memo is not None and path in memo:
            return memo[path]
        if node is False:
            return False
        if not isinstance(node, dict):
            return True

        def sub(child, at):
            return matchable(child, at, memo)

        if path in ref_at and ref_at[path] not in ends:
            return False
        if isinstance(node.get("allOf"), list) and \
                not all(sub(b, f"{path}/allOf/{i}") for i, b in enumerate(node["allOf"])):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and \
                    not any(sub(b, f"{path}/{key}/{i}") for i, b in enumerate(node[key])):
                return False
        kind = node.get("type")
        if kind in ("object", ["object"]) and isinstance(node.get("required"), list):
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            if any(isinstance(r, str) and r in props and not sub(props[r], f"{path}/properties/{pointer(r)}")
                   for r in node["required"]):
                return False
        if kind in ("array", ["array"]):
            least = node.get("minItems", 0)
            least = least if isinstance(least, int) and not isinstance(least, bool) else 0
            items = node.get("items")
            first, at = (node["prefixItems"], "prefixItems") if isinstance(node.get("prefixItems"), list) else \
                (items, "items") if isinstance(items, list) else ([], "")
            rest, rest_at = (node.get("additionalItems"), "additionalItems") if isinstance(items, list) else (items, "items")
            if not all(sub(b, f"{path}/{at}/{i}") for i, b in enumerate(first[:least])) or \
                    (least > len(first) and rest is not None and not sub(rest, f"{path}/{rest_at}")):
                return False
        return True

    users = {}                              # target -> the targets whose subtrees hold a $ref to it
    for path, used in ref_at.items():
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            holder = "/".join(parts[:i])
            if holder in targets:
                users.setdefault(used, []).append(holder)
    _least_fixpoint(ends, targets, lambda at: matchable(targets[at], at), users)
    return matchable, len(ends) < len(targets)


def _least_fixpoint(done: set, names, holds, users: dict) -> None:
    """Adds to done each name that holds once the names in done do (a worklist: each name is tried
    again only when one it uses joins)."""
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in done and holds(name):
            done.add(name)
            todo.extend(users.get(name, ()))


def _ref_parts(ref: str) -> list[str] | None:
    """The keys of a local $ref's JSON pointer, unescaped ([] for "#"), or None: not a local pointer."""
    from urllib.parse import unquote

    if ref == "#":
        return []
    if not ref.startswith("#/"):
        return None
    return [unquote(part).replace("~1", "/").replace("~0", "~") for part in ref[2:].split("/")]


def _at(schema, parts: list[str]):
    """The node at those keys, or None."""
    node = schema
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_LARK_TOKEN = re.compile(r"""(?P<skip>[ \t\r\f]+|//[^\n]*)|(?P<nl>\n)
    |(?P<term>"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|<[^<>\n]*>)
    |(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<num>-?[0-9]+)|(?P<op>\.\.|->|.)""", re.VERBOSE)


def unending_rules(lark: str) -> list[str]:
    """When `start` derives no finite text, the rules reachable from it that derive none, in the order
    written; else [] (also when the grammar holds what this reading does not know: llguidance judges it).
    A rule can end when one of its alternatives has only items that can: a terminal, an optional or
    starred item, a group that can, a rule that can (the least fixpoint)."""
    rules = _lark_rules(lark)
    if rules is None or "start" not in rules:
        return []
    ends = {name for name, body in rules.items() if body is None}      # rules with attributes: lexemes

    def can_end(alts) -> bool:
        return any(all(can_end_item(item) for item in alt) for alt in alts)

    def can_end_item(item) -> bool:
        if isinstance(item, str):
            return item in ends or item not in rules
        return item is True or can_end(item)

    users = {}
    for name, body in rules.items():
        for used in set(_refs(body or [])):
            users.setdefault(used, []).append(name)
    _least_fixpoint(ends, rules, lambda name: can_end(rules[name]), users)
    if "start" in ends:
        return []
    seen, todo = {"start"}, ["start"]
    while todo:
        body = rules[todo.pop()] or []
        for name in _refs(body):
            if name in rules and name not in seen:
                seen.add(name)
                todo.append(name)
    return [name for name in rules if name in seen and name not in ends]


def _refs(alts):
    for alt in alts:
        for item in alt:
            if isinstance(item, str):
                yield item
            elif isinstance(item, list):
                yield from _refs(item)


def _lark_rules(lark: str) -> dict | None:
    """{rule: alternatives} of a Lark grammar, each alternative a list of items: True (a terminal, or
    an item that may be absent), a rule's name, or a group's alternatives; None as the body of a rule
    with attributes other than `[capture]` (`[stop=...]`, `[lazy]`: a lexeme). None when the text
    holds a line this reading does not know (llguidance judges such grammars alone)."""
    tokens = [(m.lastgroup, m.group()) for m in _LARK_TOKEN.finditer(lark) if m.lastgroup != "skip"]
    bodies, depth, i, current = {}, 0, 0, None
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "nl" or (depth == 0 and (i == 0 or tokens[i - 1][0] == "nl")):
            if kind == "nl":
                i += 1
                continue
            head = _definition(tokens, i)
            if head is not None:                    # a rule (lower case) or a TOKEN: its body follows
                name, attributes, i = head
                current = bodies.setdefault(name, []) if _is_rule(name) else None
                if current is not None and attributes - {"capture"}:       # stop=, max_tokens=, lazy: a lexeme
                    bodies[name] = current = None
                continue
            if text == "%" and i + 1 < len(tokens) and tokens[i + 1][1] in ("import", "ignore", "llguidance", "declare"):
                current = None
            elif text != "|":
                return None
        depth += {"{": 1, "}": -1}.get(text, 0)
        if current is not None:
            current.append((kind, text))
        i += 1
    rules = {}
    for name, body in bodies.items():
        if body is None:
            rules[name] = None
            continue
        alts, end = _lark_alts(body, 0, None)
        if alts is None or end != len(body):
            return None
        rules[name] = alts
    return rules


def _is_rule(name: str) -> bool:
    return name.lstrip("_")[:1].islower()


def _definition(tokens, i):
    """(name, the names in its attributes, index past its colon) when a rule or token definition starts at i."""
    j = i + (tokens[i][1] in ("?", "!"))
    if j >= len(tokens) or tokens[j][0] != "name":
        return None
    name, j = tokens[j][1], j + 1
    attributes, bracket = set(), j < len(tokens) and tokens[j][1] == "["
    while bracket and j < len(tokens) and tokens[j][1] != "]":
        attributes |= {tokens[j][1]} if tokens[j][0] == "name" else set()
        j += 1
    j += bracket
    if j + 1 < len(tokens) and tokens[j][1] == "." and tokens[j + 1][0] == "num":     # a priority
        j += 2
    return (name, attributes, j + 1) if j < len(tokens) and tokens[j][1] == ":" else None


def _lark_alts(body, i, closer):
    """(alternatives, index past closer) of the expansion at body[i], or (None, None)."""
    alts = [[]]
    while i < len(body) and body[i][1] != closer:
        if body[i][1] == "|":
            alts.append([])
            i += 1
        elif body[i][1] == "->" and i + 1 < len(body) and body[i + 1][0] == "name":     # an alias
            i += 2
        else:
            item, i = _lark_item(body, i)
            if i is None:
                return None, None
            alts[-1].append(item)
    if closer is not None and i >= len(body):
        return None, None
    return alts, i + (closer is not None)


def _lark_item(body, i):
    """(item, index past it) of the atom at body[i] and its operators (? * + ~n x{m,n} ".."), or (None, None)."""
    kind, text = body[i]
    if kind == "term" or (kind == "name" and not _is_rule(text)):
        item, i = True, i + 1
    elif kind == "name":
        item, i = text, i + 1
    elif text in ("(", "["):
        alts, i = _lark_alts(body, i + 1, ")" if text == "(" else "]")
        if alts is None:
            return None, None
        item = alts if text == "(" else True
    elif text == "%" and i + 2 < len(body) and body[i + 1][0] == "name" and body[i + 2][1] == "{":
        depth, i = 0, i + 2                                     # %json {...}: a terminal
        while i < len(body):
            depth += {"{": 1, "}": -1}.get(body[i][1], 0)
            i += 1
            if depth == 0:
                break
        item = True
    else:
        return None, None
    while i < len(body) and body[i][1] in ("?", "*", "+", "..", "~", "{"):
        op, i = body[i][1], i + 1
        if op in ("?", "*"):
            item = True
        elif op == "..":                                        # "a".."z"
            i += 1
        elif op in ("~", "{"):                                  # x~2, x~0..3, x{2,3}, x{,3}
            least = int(body[i][1]) if i < len(body) and body[i][0] == "num" else 0
            while i < len(body) and (body[i][0] == "num" or body[i][1] in ("..", ",")):
                i += 1
            if op == "{":
                if i >= len(body) or body[i][1] != "}":
                    return None, None
                i += 1
            item = True if least <= 0 else item
    return item, i
