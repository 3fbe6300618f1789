"""Structured outputs (JSON schema, regex, choice, grammar) on llguidance.

Why llguidance (measured on SmolLM2's 49152-token vocabulary, README "Structured outputs"):
a pure Rust wheel with no dependencies (xgrammar pulls triton, ~1 GB, and transformers onto a
CPU box), grammars built lazily (under a millisecond per schema, against xgrammar's ~20 ms
compile), matchers copied in microseconds (deep_copy), `validate_tokens` to check a draft
without moving, Lark grammars plus a GBNF converter, and the widest JSON-schema coverage of the
three (outlines-core turns schemas into one regex: no recursion, ~150 ms index per schema).

One request's `Grammar` keeps its matcher at the committed output. A speculative step asks
for the masks of several paths after it (a chain's prefixes, a tree's root-to-node paths): a
copy of the matcher walks to each path (going on from the copy taken furthest along it,
consuming the rest), writes the mask, and the step's masks are cached, so the proposer's q and
the verifier's p read the same rows. After verification `advance` moves the committed matcher
on by the emitted tokens; what a rejected path did to its copy is forgotten.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict

import torch
from torch import Tensor

from .config import StructuredOutputsConfig, StructuredOutputsParams
from .grammar_ends import (Refs, map_document, map_schemas, never_ends, ref_targets, unending_rules,
                           without_dead_ends)

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """An invalid schema, regex or grammar; `field` names the structured_outputs field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"structured_outputs.{field} is invalid: {message}")
        self.field, self.detail = field, message


def mask_words(vocab_size: int) -> int:
    """int32 words of a bitmask over vocab_size tokens."""
    return (vocab_size + 31) // 32


def _grammar_text(spec: StructuredOutputsParams, config: StructuredOutputsConfig | None = None) -> str:
    import llguidance

    json_options = _json_options(spec, config)
    kind = spec.kind
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, **json_options)
        if kind == "json":
            # closed objects whatever disable_additional_properties says (xgrammar's strict mode)
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return llguidance.LLMatcher.grammar_from_json_schema(_prepared(schema), **json_options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_classes(spec.regex))
        if kind == "choice":
            # one lexeme (a token-level automaton), not parser alternatives: thousands of labels
            # would overflow a parser row (llguidance's max_items_in_row)
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}\n")
        if kind == "structural_tag":
            return _structural_tag_grammar(spec.structural_tag)
        return llguidance.LLMatcher.grammar_from_lark(_lark(spec.grammar))
    except GrammarError:
        raise
    except Exception as e:          # a schema that is not JSON, a GBNF text that does not parse
        raise GrammarError(kind, str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _json_options(spec: StructuredOutputsParams, config: StructuredOutputsConfig | None = None) -> dict:
    config = config or StructuredOutputsConfig()
    # compact JSON unless asked (no free whitespace): a small model cannot loop on blank lines,
    # and every bounded schema has a bounded output
    no_whitespace = spec.disable_any_whitespace if spec.disable_any_whitespace is not None \
        else config.disable_any_whitespace
    # oneOf as anyOf (xgrammar's reading: llguidance otherwise refuses branches it cannot prove disjoint);
    # lenient: a keyword or string format llguidance lacks is a warning, not an error. check() then
    # refuses all but those xgrammar, vLLM's default backend, leaves out too (_IGNORED: not,
    # if/then/else, ...), which it logs; _enforceable has refused the others already, naming where
    json_options = {"defaults": {"whitespace_flexible": no_whitespace is False, "coerce_one_of": True,
                                 "lenient": True}}
    if spec.whitespace_pattern is not None:
        json_options["overrides"] = {"whitespace_pattern": spec.whitespace_pattern}
    return json_options


def _lark(grammar: str) -> str:
    """A request's grammar as Lark, read as vLLM reads it: GBNF when it has `::=` (converted),
    else Lark, `?` rules (inlined) included, whose root is `start` or else its first rule
    (llguidance's own detection took `?start:` or a first rule named otherwise for GBNF)."""
    if "::=" in grammar:
        from llguidance.gbnf_to_lark import any_to_lark

        return any_to_lark(_gbnf_escapes(grammar))
    rules = re.findall(r"^[ \t]*\??([a-z_][a-z0-9_]*)(?:\.-?\d+)?[ \t]*:", grammar, re.M)
    if rules and "start" not in rules:
        grammar = f"start: {rules[0]}\n{grammar}"
    return grammar


def _structural_tag_grammar(tag: dict | str) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) as
    an llguidance grammar: free text, where a trigger starts a segment that must be one of the
    structures whose begin starts with it (its JSON schema between begin and end)."""
    import llguidance

    def bad(message: str):
        return GrammarError("structural_tag", message)

    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise bad(f"not JSON: {e}") from None
    if not isinstance(tag, dict):
        raise bad("must be an object with structures and triggers")
    if "format" in tag:
        tag = _legacy_tag(tag["format"], bad)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise bad("triggers must be a non-empty list of strings")
    if not isinstance(structures, list) or not structures:
        raise bad("structures must be a non-empty list of {begin, schema, end}")
    tags = []
    for i, s in enumerate(structures):
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), (dict, str))):
            raise bad(f"structures[{i}] must have begin and end strings and a JSON schema")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise bad(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers {triggers}")
        schema = json.loads(s["schema"]) if isinstance(s["schema"], str) else s["schema"]
        schema = _prepared(schema, f"structures[{i}].schema#")
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {"coerce_one_of": True, "lenient": True, **schema.get("x-guidance", {})}}
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags))


def _legacy_tag(fmt, bad) -> dict:
    """vLLM's newer structural tag ({"format": xgrammar's structural-tag format}) in the form
    above, for the case llguidance's StructTag has: a `triggered_tags` format whose tags' contents
    are JSON schemas (what vLLM builds for tool calls). Other formats are refused by name."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind != "triggered_tags":
        raise bad(f"format of type {kind!r} is not supported: specdec takes the `triggered_tags` format "
                  f"(tags whose content is a json_schema) or the older form with structures and triggers")
    for key in ("at_least_one", "stop_after_first"):
        if fmt.get(key):
            raise bad(f"format.{key} is not supported (llguidance's structural tags allow any number of tags)")
    unknown = sorted(set(fmt) - {"type", "triggers", "tags", "at_least_one", "stop_after_first"})
    if unknown:
        raise bad(f"format takes type, triggers and tags; got {', '.join(unknown)}")
    tags = fmt.get("tags")
    if not isinstance(tags, list):
        raise bad("format.tags must be a list of {begin, content, end}")
    structures = []
    for i, t in enumerate(tags):
        content = t.get("content") if isinstance(t, dict) else None
        if not (isinstance(content, dict) and content.get("type") == "json_schema" and "json_schema" in content):
            raise bad(f"format.tags[{i}].content must be {{\"type\": \"json_schema\", \"json_schema\": ...}} "
                      f"(other contents are not supported)")
        structures.append({"begin": t.get("begin"), "schema": content["json_schema"], "end": t.get("end")})
    return {"structures": structures, "triggers": fmt.get("triggers")}


def closed_objects(schema):
    """A copy of schema where each object that lists its keys (`properties` or `patternProperties`)
    and leaves additionalProperties unsaid says false: an output holds the keys its schema declares
    and no others, as vLLM's default backend compiles schemas (xgrammar's strict mode) and OpenAI's
    strict mode requires; `"additionalProperties": true` (or a schema) keeps an object open. Only
    schemas are walked: schema positions and $ref targets elsewhere (`#/components/schemas/Pet`), never
    a const, enum, default or examples value. Left as written:
    an object that lists nothing (`{"type": "object"}`, a free-form dict), one whose required keys
    are not all listed, and one merged with another schema that may declare more keys (an allOf
    branch or a definition such a branch refers to, a node with allOf / anyOf / oneOf / $ref beside
    its properties, an anyOf / oneOf branch under properties of its parent): closing one side would
    refuse the keys the other declares."""
    shared = set()       # definitions merged with other schemas where they are referred to
    refs = Refs(schema)

    def note(node, path, merged):
        if isinstance(node.get("$ref"), str) and (merged or "properties" in node or "patternProperties" in node):
            shared.add(refs.named(path, node["$ref"]))
        return node

    def close(node, path, merged):
        listed, patterns = node.get("properties"), node.get("patternProperties")
        if not (isinstance(listed, dict) or isinstance(patterns, dict)) or merged or path in shared:
            return node
        if any(k in node for k in ("additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")):
            return node
        required = node.get("required")
        if patterns is None and isinstance(required, list) and any(r not in (listed or {}) for r in required):
            return node
        return {**node, "additionalProperties": False}

    reach = ref_targets(schema, refs=refs)
    map_schemas(schema, note, reach=reach)
    return map_schemas(schema, close, reach=reach)


def _prepared(schema, root: str = "#"):
    """schema as llguidance is given it (a copy): what it cannot enforce refused, closed objects,
    xgrammar's regex classes, subschemas that can only recurse made `false` (a reply that started
    one could never end: llguidance forced its text until its parser limit, then aborted)."""
    return _ascii_patterns(closed_objects(_enforceable(without_dead_ends(schema), root)))


# keywords llguidance lacks that xgrammar (vLLM's default backend) leaves out with a warning: left out
# here too, with one (check() logs llguidance's); `dependencies` is draft 7's dependentRequired / dependentSchemas
_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies")
# string formats xgrammar checks and llguidance lacks: any string here, with a warning (README)
_IGNORED_FORMATS = ("uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
# keywords llguidance lacks that change which values are valid: refused, as vLLM refuses them (xgrammar
# lacks them, so vLLM hands such a schema to its guidance backend, which runs llguidance without lenient)
_REFUSED = ("uniqueItems", "contains", "minContains", "maxContains", "propertyNames", "$dynamicRef", "$recursiveRef")


def _enforceable(schema, root: str = "#"):
    """A copy of schema with nothing the grammar would quietly leave out, or ValueError naming the
    first keyword llguidance cannot enforce and the JSON pointer of its schema (`uniqueItems (at
    #/properties/tags)`). xgrammar's readings first: an object's `unevaluatedProperties` is its
    additionalProperties, an array's `unevaluatedItems` its items, where those are unsaid (beside them
    they add nothing). Keywords that constrain nothing are dropped (`uniqueItems: false`, min/maxContains
    without contains, `propertyNames: {}`, the anchors of $dynamicRef); what sits under an ignored
    keyword (`not`, `if`, ...) is never refused. What llguidance reads as a schema is walked: schema
    positions (a property named "contains" is not the keyword) and the $ref targets elsewhere (OpenAPI's
    `#/components/schemas/Pet`). There a refused keyword is left for llguidance's own warning to name
    (check()), which counts only the targets it reaches; a format is judged here wherever it is (that
    warning cannot tell a string's format from an annotation)."""
    refused, ignored, refs = [], [], set()     # refs: the paths of the nodes $refs name
    resolver = Refs(schema, root)
    reach = ref_targets(schema, root, resolver)
    aside = [at for at, target in reach.items() if target]

    def visit(node, path, merged):
        named = resolver.named(path, node["$ref"]) if isinstance(node.get("$ref"), str) else None
        if named is not None:
            refs.add(named)
        if isinstance(node.get("$dynamicAnchor"), str) and "$anchor" not in node:
            # dropped below, but a $dynamicAnchor is a plain name as well: a $ref may name it
            node["$anchor"] = node["$dynamicAnchor"]
        rest = "additionalItems" if isinstance(node.get("items"), list) else "items"
        for uneval, plain in (("unevaluatedProperties", "additionalProperties"), ("unevaluatedItems", rest)):
            if uneval in node:
                node.setdefault(plain, node.pop(uneval))
        if "contains" in node and node.get("minContains") == 0 and "maxContains" not in node:
            del node["contains"]
        noop = {"uniqueItems": node.get("uniqueItems") is False, "$dynamicAnchor": True, "$recursiveAnchor": True,
                "minContains": "contains" not in node, "maxContains": "contains" not in node,
                "propertyNames": node.get("propertyNames") in (True, {}, {"type": "string"})}
        node = {k: v for k, v in node.items() if not noop.get(k)}
        ignored.extend(f"{path}/{k}" for k in _IGNORED if k in node)
        lacking = [] if _under(path, aside) else [k for k in _REFUSED if k in node]
        fmt = node.get("format")
        # a format checks a node typed "string" (vLLM's test for xgrammar): on an untyped node or a type list
        # (OpenAPI 3.1's ["string", "null"]) one llguidance lacks is an annotation, logged by check()
        if isinstance(fmt, str) and fmt not in _IGNORED_FORMATS and node.get("type") == "string" \
                and not _has_format(fmt):
            lacking.append(f"format {json.dumps(fmt)}")
        if lacking:
            refused.append((path, ", ".join(lacking)))
        return node

    out = map_schemas(schema, visit, root, reach=reach)
    for path, what in refused:
        if not _under(path, ignored) and _used(path, refs):
            raise ValueError(f"{what} (at {path}) {_UNENFORCEABLE}")
    return out


def _under(path: str, places) -> bool:
    """Whether path is one of places or inside one."""
    return any(path == at or path.startswith(at + "/") for at in places)


def _used(path: str, refs: set) -> bool:
    """Whether the subschema at path can shape a value: not inside a definition no $ref names
    (llguidance reads only the definitions it reaches)."""
    parts = path.split("/")
    for i, part in enumerate(parts[:-1]):
        if part in ("$defs", "definitions"):
            at = "/".join(parts[:i + 2])
            if at not in refs and not any(r.startswith(at + "/") for r in refs):
                return False
    return True


@functools.lru_cache(maxsize=1024)
def _has_format(name: str) -> bool:
    """Whether llguidance checks this string format (it lists no formats: ask it, once per name)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
    return not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]


def _unenforced(warning: str) -> str | None:
    """What llguidance's lenient reading would leave out that is not on the ignored lists (a keyword
    _enforceable left to it: in a $ref target outside schema positions), as an error message; else
    None (formats too)."""
    keys = re.match(r"Unimplemented keys: (\[.*\])", warning)
    if keys:
        missing = [k for k in json.loads(keys[1]) if k not in _IGNORED]
        return f"{', '.join(missing)} {_UNENFORCEABLE}" if missing else None
    # an unknown format on a node typed "string" was refused by _enforceable; on an untyped node or a
    # type list it is an annotation (vLLM hands xgrammar's schema to its fallback for type "string" only)
    return None


_UNENFORCEABLE = "is not supported: the grammar cannot enforce it, so the output could break the schema"


def ascii_classes(regex: str) -> str:
    """regex with \\d \\w \\s and their negations as xgrammar's regex converter (vLLM's default
    backend) reads them, ECMAScript's: [0-9], [a-zA-Z0-9_], [\\f\\n\\r\\t\\v \\xA0]; llguidance's
    are Unicode's (a fullwidth "４" for \\d). Written as nested classes, valid inside a class too.
    Explicit classes (`[٠-٩]`, `\\p{L}`) keep what they say."""
    out, i = [], 0
    while i < len(regex):
        pair = regex[i:i + 2]
        if pair[:1] == "\\" and len(pair) == 2:
            out.append(_ASCII_CLASSES.get(pair[1], pair))
            i += 2
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)


_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[a-zA-Z0-9_]", "W": "[^a-zA-Z0-9_]",
                  "s": r"[\f\n\r\t\v \xA0]", "S": r"[^\f\n\r\t\v \xA0]"}


def _ascii_patterns(schema):
    """schema with ascii_classes applied to its `pattern`s and `patternProperties` (so \\s means
    in a JSON schema what it means in a guided regex). A copy."""
    def visit(node, path, merged):
        if isinstance(node.get("pattern"), str):
            node = {**node, "pattern": ascii_classes(node["pattern"])}
        if isinstance(node.get("patternProperties"), dict):
            node = {**node, "patternProperties": {ascii_classes(k): v for k, v in node["patternProperties"].items()}}
        return node

    return map_document(schema, visit)


def no_finite_output(spec: StructuredOutputsParams) -> str | None:
    """Why no finite text satisfies spec, or None: a JSON schema whose every value needs itself
    (a required property whose schema refers back to its own object), a Lark or GBNF grammar whose
    start rule cannot end (`start: "a" start`). llguidance admits these, then runs until its parser
    limit; the checks are sound (what they cannot follow counts as able to end), not complete."""
    try:
        if spec.kind == "json":
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return _NO_TEXT["json"] if never_ends(schema) else None
        if spec.kind == "grammar":
            stuck = unending_rules(_lark(spec.grammar))
            if "::=" in spec.grammar:                   # GBNF's root is Lark's start
                stuck = ["root" if r == "start" else r for r in stuck]
            return (f"no finite text matches the grammar: {', '.join(stuck[:5])} can only recurse (every "
                    f"alternative leads back to a rule that never ends)") if stuck else None
    except (ValueError, RecursionError):
        pass
    return None


def _gbnf_escapes(grammar: str) -> str:
    """A GBNF grammar with its \\uXXXX and \\UXXXXXXXX escapes (llama.cpp's and xgrammar's, in
    strings and classes) written out: the character itself, or \\xHH below 0x80 (a quote, a
    bracket, a control character). llguidance's converter drops their leading zeros ("\\u00e9"
    became "\\ue9"), which its Lark lexer refuses."""
    out, i, closing = [], 0, None          # closing: the character that ends the string or class we are in
    while i < len(grammar):
        c = grammar[i]
        if closing is None:
            if c == "#":                   # a comment, to the end of its line
                end = grammar.find("\n", i)
                end = len(grammar) if end < 0 else end
                out.append(grammar[i:end])
                i = end
                continue
            closing = '"' if c == '"' else "]" if c == "[" else None
        elif c == "\\":
            digits = {"u": 4, "U": 8}.get(grammar[i + 1:i + 2], 0)
            code = grammar[i + 2:i + 2 + digits]
            if digits and len(code) == digits and all(h in "0123456789abcdefABCDEF" for h in code):
                point = int(code, 16)
                if point > 0x10FFFF or 0xD800 <= point <= 0xDFFF:
                    raise GrammarError("grammar", f"\\{grammar[i + 1]}{code} is not a Unicode character")
                out.append(f"\\x{point:02x}" if point < 0x80 else chr(point))
                i += 2 + digits
            else:
                out.append(grammar[i:i + 2])
                i += 2
            continue
        elif c == closing:
            closing = None
        out.append(c)
        i += 1
    return "".join(out)


class GrammarCompiler:
    """Grammars for one tokenizer. The llguidance tokenizer (about half a second to build for a
    50k vocabulary) is made on first use and shared; check() is safe from any thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], config: StructuredOutputsConfig | None = None):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self.config = config or StructuredOutputsConfig()
        self._ll = None
        self._markers = None
        parser = self.config.reasoning_parser
        if parser and not self.config.enable_in_reasoning and not self.has_reasoning_tokens(parser):
            # vLLM's parser refuses such a tokenizer: its markers would be several ordinary tokens,
            # which a model never writes, and the grammar would wait for them forever
            raise ValueError(f"structured_outputs_config.reasoning_parser {parser!r}: the tokenizer has no "
                             f"{' / '.join(REASONING_TOKENS[parser])} tokens, so the end of reasoning cannot be "
                             "found (set enable_in_reasoning to constrain the reply from its first token)")
        self._lock = threading.Lock()
        # grammar texts check() has validated (where the server prepares requests, off its engine
        # thread): grammar() on the engine thread then only compiles the request's own matcher
        self._validated: OrderedDict[str, bool] = OrderedDict()

    def _lltokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance
                self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos_ids)
            return self._ll

    def prepare(self) -> None:
        """Build the llguidance tokenizer now (a server does it at start, off its event loop)."""
        self._lltokenizer()

    def check(self, spec: StructuredOutputsParams) -> str:
        """The grammar text of spec, or GrammarError naming the field. A text once validated is
        remembered (the last VALIDATED_CACHE), so the engine's grammar() does not validate again."""
        import llguidance

        frozen = spec.__dict__.get("_frozen")
        if frozen is not None and frozen[0] is self:
            return frozen[1]                       # validated when frozen
        text = _grammar_text(spec, self.config)
        with self._lock:
            if text in self._validated:
                self._validated.move_to_end(text)
                return text
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self._lltokenizer())
        if is_error:
            raise GrammarError(spec.kind, _first_line(messages[0]))
        for message in messages:        # what the lenient JSON schema reading left out: refused unless ignorable
            refused = _unenforced(_first_line(message))
            if refused:
                raise GrammarError(spec.kind, refused)
        endless = no_finite_output(spec)
        if endless:
            raise GrammarError(spec.kind, endless)
        if spec.kind == "json" and len(text) > LONG_VALUE:
            self._check_long_values(spec)
        for message in messages:
            log.warning("structured_outputs.%s: %s (ignored)", spec.kind, _first_line(message))
        with self._lock:
            self._validated[text] = True
            while len(self._validated) > VALIDATED_CACHE:
                self._validated.popitem(last=False)
        return text

    def _check_long_values(self, spec: StructuredOutputsParams) -> None:
        """GrammarError naming the first `const` or `enum` value too long for llguidance to write. Once a
        reply starts such a value, the rest of its text is forced, and llguidance forces it into its
        parser within one step's item limit: a value of many JSON tokens (a const array of 30000
        numbers) overflowed it after the first token and aborted the request mid-reply. Each value
        whose text is longer than LONG_VALUE is tried alone here, as decoding would write it."""
        import llguidance

        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        long_values = []

        def visit(node, path, merged):
            values = [("const", node["const"])] if "const" in node else []
            if isinstance(node.get("enum"), list):
                values += [(f"enum[{i}]", v) for i, v in enumerate(node["enum"])]
            for what, value in values:
                size = len(json.dumps(value, separators=(",", ":")))
                if size > LONG_VALUE:
                    long_values.append((f"{what} (at {path})", value, size))
            return node

        map_document(schema, visit)
        options = _json_options(spec, self.config)
        for where, value, size in long_values:
            text = llguidance.LLMatcher.grammar_from_json_schema({"const": value}, **options)
            matcher = llguidance.LLMatcher(self._lltokenizer(), text, log_level=0, limits=LIMITS())
            failed = _forcing_fails(matcher, mask_words(self.vocab_size))
            if failed:
                raise GrammarError(spec.kind, f"{where} is too long to be written: its {size} characters, forced "
                                              f"once the value starts, outgrow the grammar engine's parser [{failed}]")

    def freeze(self, spec: StructuredOutputsParams) -> str:
        """check(spec), its grammar text then kept on spec: later checks (each choice's admission on
        the engine's thread) neither serialize the schema again nor look it up, and SamplingParams.clone
        shares a frozen spec instead of deep-copying its schema. For specs nobody changes afterwards
        (a server's, built from one request's JSON)."""
        text = self.check(spec)
        object.__setattr__(spec, "_frozen", (self, text))
        return text

    def prebuild(self, spec: StructuredOutputsParams, count: int) -> None:
        """`count` matchers of a frozen spec, compiled now and kept on the spec for its requests'
        grammar() to take, one each (a server compiles them on its grammar thread while the request
        waits: llguidance lets the GIL go, so neither the engine's thread nor the event loop waits on
        it); a GrammarError as grammar()'s. They live and die with the request's params: a request
        abandoned before admission leaves nothing behind."""
        text = self.freeze(spec) if spec.__dict__.get("_frozen") is None else self.check(spec)
        made = [self._build(text, spec.kind) for _ in range(count)]
        spec.__dict__.setdefault("_prebuilt", []).extend(made)

    def grammar(self, spec: StructuredOutputsParams, prompt: list[int] | None = None) -> "Grammar | ReasoningGrammar":
        """A request's matcher, its first mask computed: one prebuild() made, else compiled here.
        With a reasoning parser (and enable_in_reasoning off) it waits behind a ReasoningGrammar
        until the reply ends its reasoning, unless the prompt did (vLLM's is_reasoning_end).
        A grammar the parser cannot run from the start (a lexer past its limits, an overflowing
        parser row) is a GrammarError, before the request is admitted. Each request has a matcher
        of its own: copies of one (LLMatcher.deep_copy) share their lexer, whose limits then run
        out across requests (a second request with the same large regex failed where the first ran)."""
        text = self.check(spec)
        made = None
        ready = spec.__dict__.get("_prebuilt")
        if ready:
            try:
                made = ready.pop()
            except IndexError:                    # another choice took the last one meanwhile
                pass
        made = made or self._build(text, spec.kind)
        markers = self.reasoning_markers()
        if markers is None or reasoning_ended(prompt or [], *markers):
            return made
        return ReasoningGrammar(made, markers[1], self.vocab_size)

    def has_reasoning_tokens(self, parser: str) -> bool:
        """Whether the tokenizer holds the parser's markers as tokens of their own (vLLM's parsers
        require them): only then does a model write the end of its reasoning as the grammar reads it."""
        return all(len(self.tokenizer.encode(t, add_special_tokens=False)) == 1 for t in REASONING_TOKENS[parser])

    def reasoning_markers(self) -> tuple[list[int], list[int]] | None:
        """(start, end) token ids of the reasoning parser's markers, or None when the grammar
        applies from the reply's first token (no parser, or enable_in_reasoning)."""
        parser = self.config.reasoning_parser
        if not parser or self.config.enable_in_reasoning:
            return None
        if self._markers is None:
            start, end = REASONING_MARKERS[parser]
            self._markers = tuple(self.tokenizer.encode(t, add_special_tokens=False) for t in (start, end))
        return self._markers

    def _build(self, text: str, kind: str) -> "Grammar":
        import llguidance

        matcher = llguidance.LLMatcher(self._lltokenizer(), text, log_level=0, limits=LIMITS())
        if matcher.is_error():
            raise GrammarError(kind, _first_line(matcher.get_error()))
        grammar = Grammar(matcher, self.vocab_size, self.eos_ids, self._lltokenizer())
        grammar.masks([[]])
        if grammar.failure is not None:
            # llguidance's NoExtensionBias before the first token (its state dump as the message):
            # no text at all matches, as for a JSON schema whose $ref leads only back to itself
            empty = grammar.failure.startswith("NoExtensionBias")
            raise GrammarError(kind, _NO_TEXT.get(kind, _NO_TEXT[None]) if empty else grammar.failure)
        return grammar


_NO_TEXT = {"json": "no JSON value matches the schema: is it recursive with no way out (a $ref that leads "
                   "only back to itself)?",
            None: "no text matches it: nothing could be generated"}

# grammar texts remembered as validated (check)
VALIDATED_CACHE = 256
# const / enum values with more characters than this are tried alone when a schema is checked
LONG_VALUE = 4096


def _forcing_fails(matcher, words: int) -> str | None:
    """What went wrong when matcher, fresh, takes the first token of its forced text and computes
    the mask after it (where llguidance forces the rest into its parser), or None."""
    row = torch.empty(words, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
    forced = [] if matcher.is_error() else matcher.compute_ff_tokens()
    if forced:
        matcher.consume_tokens(forced[:1])
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
    return matcher.get_error().strip().splitlines()[0] if matcher.is_error() else None


def LIMITS():
    """llguidance's parser limits, its row size raised from 2000 to 50000 items (a JSON
    schema's anyOf of a few thousand objects, as vLLM's xgrammar takes them); a grammar past
    them stops the request with finish_reason "abort" (Grammar.error), never a quiet "stop"."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=50000)


def _first_line(message: str) -> str:
    """llguidance's message on one line: what it says (its first lines, without the excerpt of the
    grammar it quotes, `   3 | start: "\\ue9"`, or the caret under it), then the line it points at."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    quoted = {m[1]: m[2] for m in map(_QUOTED.fullmatch, lines) if m}
    said = [ln for ln in lines if not _QUOTED.fullmatch(ln) and set(ln) != {"^"}]
    text = " ".join(said[:3]) or "rejected by the grammar compiler"
    at = re.match(r"(?:at )?(\d+)\(\d+\)", said[0]) if said else None
    if at and quoted.get(at[1]):
        line = quoted[at[1]]
        text += f" (line {at[1]}: {line if len(line) <= 160 else line[:160] + ' ...'})"
    return text


_QUOTED = re.compile(r"(\d+) \|(?: (.*))?")
_ENDLESS = re.compile(r"Too many items \([^)]*ff_tokens\)")


class Grammar:
    """One request's matcher at the committed output, and copies of it that walk a step's draft
    paths. A path that leaves the grammar is never walked past its first bad token.

    llguidance's parser can fail along a path (a limit: the text forced after `a` in
    `start: x | "b"` / `x: "a" x` outgrows a parser row), and whether it fails depends on the
    calls before: consuming a token right after the position's mask was computed fails where
    consuming it without one, or after a rollback, does not. So a walk does what plain decoding
    does, each position's mask before the token after it, and never rolls back: it goes on from
    a copy taken just after a mask (`states`). A failure met on a draft path only marks that
    path (`failed`): its row allows EOS alone, as llguidance's failed matcher, and a token that
    failed to be consumed is cut from a draft. Only a failure on the emitted tokens ends the
    request (`advance`): the output is then the tokens up to the failure and one EOS, whichever
    call met it, and `error` says why."""

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int], lltokenizer=None):
        self.committed, self.vocab_size, self.eos_ids, self.lltokenizer = matcher, vocab_size, eos_ids, lltokenizer
        self.words = mask_words(vocab_size)
        self.matcher = None                  # the copy walking this step's paths
        self.cursor: list[int] = []          # its tokens past the committed output
        self.masked = False                  # its mask computed where it stands
        self.states: dict[tuple, object] = {}    # copies of the walker after its mask at a path it left
        self.cache: dict[tuple, Tensor] = {}
        # this step's paths where the matcher failed -> how many of their tokens are valid (the
        # path's length when its mask failed, one less when its last token could not be consumed)
        self.failed: dict[tuple, int] = {}
        self.why: dict[tuple, str] = {}       # each of those paths' failure, said plainly
        self.failure: str | None = None      # the first of those failures
        # the committed output met a failure at its end (its last token could not be consumed, or
        # the mask after it could not be computed): every row allows EOS alone, as llguidance's
        # failed matcher, and the next emitted token (that EOS) sets `error`. Plain decoding and
        # speculation then end alike, whichever call met the failure (see advance)
        self.broken: str | None = None
        # the matcher's error once an emitted token made it fail (a parser or lexer limit: llguidance
        # then allows EOS alone); the engine ends the request with finish_reason "abort" instead of
        # a "stop" whose output breaks the grammar
        self.error: str | None = None

    def _walk(self, path: list[int]) -> int:
        """Move the walker to the longest valid prefix of path; returns its length."""
        path = tuple(path)
        for j in range(len(path) + 1):                 # a path through a failure stops before it
            if path[:j] in self.failed:
                path = path[:self.failed[path[:j]]]
                break
        cursor = tuple(self.cursor)
        here = self.matcher is not None and path[:len(cursor)] == cursor and not self.matcher.is_error()
        if not here or not (len(cursor) == len(path) or self.masked and path[:len(cursor) + 1] not in self.states):
            # from the copy taken furthest along path, unless the walker stands there or further
            at = next((j for j in range(len(path), -1, -1) if path[:j] in self.states), None)
            if not here or (at is not None and (at, True) > (len(cursor), self.masked)):
                start = self.committed if at is None else self.states[path[:at]]
                self.matcher, self.cursor, self.masked = start.deep_copy(), list(path[:at or 0]), at is not None
        rest = list(path[len(self.cursor):])
        n = self.matcher.validate_tokens(rest) if rest else 0
        for i, token in enumerate(rest[:n]):
            if self.matcher.is_stopped():     # EOS past the end: allowed, nothing to consume
                return len(self.cursor) + n - i
            where = tuple(self.cursor)
            if not self.masked and self._mask(where) is None:
                break
            if where not in self.states:      # where a later walk may go on from
                self.states[where] = self.matcher.deep_copy()
            self.matcher.consume_tokens([token])
            self.masked = False
            if self.matcher.is_error():
                self._fail(tuple(self.cursor) + (token,), len(self.cursor))
                break
            self.cursor.append(token)
        return len(self.cursor)

    def _mask(self, path: tuple) -> Tensor | None:
        """The mask where the walker stands (path), cached; None when computing it failed."""
        row = torch.empty(self.words, dtype=torch.int32)
        # written in place (llguidance.torch's helper would import torch.compile: seconds)
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
        self.masked = True
        if self.matcher.is_error():
            self._fail(path, len(path))
            return None
        if not row.any():          # nothing left (past the end with ignore_eos): EOS only
            row = eos_only(self.eos_ids, self.words)
        return self.cache.setdefault(path, row)

    def _fail(self, path: tuple, valid: int) -> None:
        self.failed[path] = valid
        self.why[path] = _failure(self.matcher.get_error())
        self.failure = self.failure or self.why[path]

    def masks(self, paths: list[list[int]]) -> Tensor:
        """[len(paths), words] int32: the allowed next tokens after the committed output plus
        each path. A path that leaves the grammar gets the mask of its valid prefix: its row is
        never reached (the bad token has p = 0, so it is rejected first), any real mask will do.
        A path through a failure of the matcher allows EOS alone."""
        if self.broken is not None:
            return eos_only(self.eos_ids, self.words).repeat(len(paths), 1)
        out = torch.empty(len(paths), self.words, dtype=torch.int32)
        for i, path in enumerate(paths):
            key = tuple(path)
            row = self.cache.get(key)
            if row is None:
                n = self._walk(path)
                if key[:n] in self.failed or key[:n + 1] in self.failed:
                    row = eos_only(self.eos_ids, self.words)
                else:
                    row = self.cache.get(key[:n])
                    if row is None:
                        row = self._mask(key[:n])
                    if row is None:
                        row = eos_only(self.eos_ids, self.words)
                self.cache[key] = row
            out[i] = row
        return out

    def valid_prefix(self, path: list[int]) -> int:
        """How many leading tokens of path the grammar allows after the committed output."""
        return 0 if self.broken is not None else self._walk(path)

    def forced(self, path: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after the committed output plus path (the
        canonical tokens of bytes it leaves no choice about: `","name":"` between two JSON
        fields); [] when path leaves the grammar."""
        if limit <= 0 or self.broken is not None or self._walk(path) < len(path) or tuple(path) in self.failed:
            return []
        ff = self.matcher.compute_ff_tokens()
        if self.lltokenizer is not None:
            # llguidance stops its forced tokens before the last token boundary that the next
            # bytes could still move (`":"` may merge with a string's first letters); as a draft
            # the plain tokenization of the forced bytes is worth trying: a wrong guess is
            # rejected like any draft
            forced_bytes = self.matcher.compute_ff_bytes()
            if forced_bytes:
                ff = self.lltokenizer.tokenize_bytes(forced_bytes)
        self.matcher = None          # plain decoding computes no forced text: walk on from a copy
        ff = ff[:limit]
        return ff[:self._walk(list(path) + ff) - len(path)] if ff else []

    def advance(self, tokens: list[int]) -> None:
        """The step's verdict: the committed output moves on by what was emitted (every token but
        EOS past the end), walked as plain decoding would; a failure there ends the request.

        Where a failure ends it does not depend on which call met it. Plain decoding meets a
        parser limit either consuming a token or computing the mask after it (the step's walks,
        or the matcher's shared lexer, decide which), and speculation may meet it on a draft that
        is then accepted, with the token after it drawn from the failed row (EOS alone). So the
        emitted tokens are read against the failures this step's walks met before any walk again:
        tokens past a failure (that EOS) end the request now (`error`); a failure at their end
        makes the output `broken`, whose next token, an EOS, ends it. Either way the output is the
        tokens up to the failure, then one EOS, then finish_reason "abort"."""
        tokens = list(tokens)
        if self.broken is not None:
            if tokens and self.error is None:
                self.error = self.broken
        elif tokens:
            hit = self._failure_on(tokens)
            if hit is None or hit[0] == len(tokens):       # walked again as plain decoding walks them
                self.failed.clear()
                self.why.clear()
                self._walk(tokens)
                hit = self._failure_on(tokens)
                if hit is None and self.matcher.is_error():
                    hit = len(tokens), _failure(self.matcher.get_error())
            if hit is None:
                self.committed = self.matcher
            elif hit[0] < len(tokens):
                self.error = self.error or hit[1]
            else:
                self.broken = hit[1]
        self.matcher, self.cursor, self.masked = None, [], False
        self.states.clear()
        self.cache.clear()
        self.failed.clear()
        self.why.clear()
        self.failure = None

    def _failure_on(self, tokens: list[int]) -> tuple[int, str] | None:
        """(how many of tokens come before the failure this step's walks met along them, what it
        was): a path whose mask failed ends there, one whose last token failed ends with it."""
        if not self.failed:             # the usual step: no walk failed
            return None
        for j in range(len(tokens) + 1):
            key = tuple(tokens[:j])
            if key in self.failed:
                return j, self.why.get(key) or self.failure or "the grammar's matcher failed"
        return None

    def is_accepting(self) -> bool:
        return self.broken is None and self.committed.is_accepting()


def _failure(message: str) -> str:
    """llguidance's error on one line, the parser's overflow on forced text said plainly."""
    text = _first_line(message)
    endless = _ENDLESS.search(text)
    if endless:
        # the only text the grammar allows from here (its forced bytes) outgrew the parser: text
        # with no end (after "a" in `start: "a" start | "b"`; no_finite_output refuses grammars
        # that end nowhere up front), or a very long one (a const array of 30000 items)
        text = ("the text the constraint forces from here outgrew the parser: it may have no end "
                "(a rule or schema that can only recurse admits no finite output) "
                f"[{endless[0]}]")
    return text


# a reasoning parser's (start, end) markers: the grammar starts after the end's tokens. harmony's
# reply is reasoning until its final channel opens; its prompt ends with `<|start|>assistant`
REASONING_MARKERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>"),
                     "openai_gptoss": ("<|start|>assistant", "<|channel|>final<|message|>")}
# the tokens those markers are made of, each one token in the parser's models (vLLM's requirement)
REASONING_TOKENS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>"),
                    "openai_gptoss": ("<|start|>", "<|channel|>", "<|message|>")}


def _find(seq: list[int], marker: list[int], start: int = 0) -> int:
    """Where marker first ends in seq[start:] (an index into seq past it), or -1."""
    n = len(marker)
    for i in range(start, len(seq) - n + 1):
        if seq[i:i + n] == marker:
            return i + n
    return -1


def reasoning_ended(prompt: list[int], start: list[int], end: list[int]) -> bool:
    """vLLM's is_reasoning_end on a prompt: its last marker is an end (a chat template that closed
    the think block: Qwen3 with thinking off); one that opens a block or has neither leaves the
    reply reasoning."""
    n = max(len(start), len(end))
    for i in range(len(prompt), 0, -1):
        tail = prompt[max(0, i - n):i]
        if tail[len(tail) - len(start):] == start:
            return False
        if tail[len(tail) - len(end):] == end:
            return True
    return False


class ReasoningGrammar:
    """A Grammar that lets the reply reason freely: every token is allowed until the reasoning
    parser's end marker (`</think>`) has been emitted, and the grammar constrains what follows
    (vLLM's structured outputs with enable_in_reasoning off). Lossless under speculation: a
    draft path's mask is free while the path (after the committed output) has not completed the
    marker, and the grammar's mask after the part of the path past it when it has, so a path
    with `</think>` at its 2nd token is constrained from its 3rd; the walk is undone by advance()
    as the grammar's own."""

    def __init__(self, grammar: Grammar, end: list[int], vocab_size: int):
        self.grammar, self.end = grammar, list(end)
        self.ended = False
        self.tail: list[int] = []        # the committed output's last tokens (a marker split across steps)
        self.free = torch.full((mask_words(vocab_size),), -1, dtype=torch.int32)     # every token

    @property
    def error(self) -> str | None:
        return self.grammar.error

    def _after(self, path: list[int]) -> int:
        """Where the grammar's part of path starts (0 once reasoning has ended), or -1: none yet."""
        if self.ended:
            return 0
        at = _find(self.tail + list(path), self.end)
        return at - len(self.tail) if at >= 0 else -1

    def masks(self, paths: list[list[int]]) -> Tensor:
        cuts = [self._after(p) for p in paths]
        out = self.free.repeat(len(paths), 1)
        constrained = [i for i, c in enumerate(cuts) if c >= 0]
        if constrained:
            out[constrained] = self.grammar.masks([list(paths[i][cuts[i]:]) for i in constrained])
        return out

    def valid_prefix(self, path: list[int]) -> int:
        cut = self._after(path)
        return len(path) if cut < 0 else cut + self.grammar.valid_prefix(list(path[cut:]))

    def forced(self, path: list[int], limit: int) -> list[int]:
        cut = self._after(path)
        return [] if cut < 0 else self.grammar.forced(list(path[cut:]), limit)

    def advance(self, tokens: list[int]) -> None:
        cut = self._after(tokens)
        if cut < 0:
            self.tail = (self.tail + list(tokens))[-(len(self.end) - 1):] if len(self.end) > 1 else []
            self.grammar.advance([])       # back to where it was (a step's walk undone)
            return
        self.ended, self.tail = True, []
        self.grammar.advance(list(tokens[cut:]))

    def is_accepting(self) -> bool:
        return self.ended and self.grammar.is_accepting()


def eos_only(eos_ids: list[int], words: int) -> Tensor:
    row = torch.zeros(words, dtype=torch.int32)
    for t in eos_ids:
        row[t // 32] |= _bit(t % 32)
    return row


def _bit(j: int) -> int:
    """Bit j of an int32 word (bit 31 is the sign bit)."""
    return 1 << j if j < 31 else -(1 << 31)
