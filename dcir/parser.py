"""Text -> ``Module``: the Lark grammar in ``grammar.lark`` defines the language.

One parser, Lark's, with one shortcut: op lines that repeat a shape already seen are
not re-lexed (``dcir/fast_parse.py`` says why and exactly which lines qualify). Lines
the shortcut does not take, and every error, go through the full grammar in context.
``parse(text, fast=False)`` parses with the full grammar alone; tests check that both
give the same module and the same errors.
"""

from __future__ import annotations

import gc
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, v_args
from lark.exceptions import VisitError

from dcir import custom_ops, fast_parse
from dcir.diagnostics import DcirError, Diagnostic, Note
from dcir.ir import (DTYPE_BYTES, NONE, UNIT, Decl, DType, Function, HostType, Module, Op, PendingType, ShardType,
                     Source, SymbolRef, TensorType, Value)

GRAMMAR = Path(__file__).with_name("grammar.lark")


@lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(GRAMMAR.read_text(), parser="lalr", lexer="contextual", strict=True,
                start=["start", "op"], propagate_positions=True, maybe_placeholders=True, cache=True)


# ---- tree -> raw structures ----------------------------------------------------------

@dataclass(slots=True)
class RawOp:
    results: list[Token]
    name: str
    symbol: str | None
    operands: list[Token] | None  # None: written without parentheses
    attrs: dict
    types: list
    line: int
    col: int


@dataclass(slots=True)
class RawFunc:
    name: str
    args: list            # (value token, type, attribute dict)
    results: list         # (type, attribute dict)
    role: str | None
    attrs: dict
    ops: list[RawOp]
    ret: list[Token]
    line: int
    col: int
    end_line: int
    ret_loc: tuple[int, int]


def unquote_symbol(tok: str) -> str:
    body = tok[1:]
    return json.loads(body) if body.startswith('"') else body


_DIMS = re.compile(r"[0-9]+")


@lru_cache(maxsize=4096)
def tensor_type(text: str) -> TensorType:
    dtype, dims = text.split("[", 1)
    return TensorType(dtype, tuple(int(d) for d in _DIMS.findall(dims)))


class _ToRaw(Transformer):
    """Turns the parse tree into raw structures; value names stay tokens (with positions)."""

    # types
    def tensor_type(self, c):
        return tensor_type(str(c[0]))

    def shard_type(self, c):
        inner, over, parts = c
        if not isinstance(inner, TensorType):
            raise _SemanticError(f"a shard is a shard of a tensor type, not of {inner}", parts)
        if int(parts) < 1:
            raise _SemanticError("a shard splits a tensor across at least 1 rank", parts)
        return ShardType(inner, int(parts), str(over) if over is not None else None)

    def pending_type(self, c):
        return PendingType(c[0])

    @v_args(meta=True)
    def host_type(self, meta, c):
        if not isinstance(c[0], (TensorType, ShardType)):
            raise _SemanticError(f"host<...> holds a tensor or a shard, not {c[0]}", _Span(meta))
        return HostType(c[0])

    def none_type(self, c):
        return NONE

    # attributes
    def int_attr(self, c):
        return int(c[0])

    def float_attr(self, c):
        return float(c[0])

    def str_attr(self, c):
        return json.loads(c[0])

    def true_attr(self, c):
        return True

    def false_attr(self, c):
        return False

    def none_attr(self, c):
        return _NONE_ATTR

    def symbol_attr(self, c):
        return SymbolRef(unquote_symbol(c[0]))

    def dtype_attr(self, c):
        return DType(str(c[0]))

    def list_attr(self, c):
        if c == [None]:
            return ()
        return tuple(None if v is _NONE_ATTR else v for v in c)

    def attr(self, c):
        key, value = c
        name = json.loads(key) if key.type == "STRING" else str(key)
        if value is None:  # written without '= value'
            value = UNIT
        elif value is _NONE_ATTR:
            value = None
        return name, key, value

    def attr_dict(self, c):
        out = {}
        for item in c:
            if item is None:
                continue
            key, tok, value = item
            if key in out:
                raise _SemanticError(f"attribute '{key}' given twice", tok)
            out[key] = value
        return out

    def attributes(self, c):
        return c[0]

    # lists
    def value_list(self, c):
        return list(c)

    def type_list(self, c):
        return list(c)

    def operands(self, c):
        return c[0] or []

    @v_args(meta=True)
    def op(self, meta, c):
        results, name, symbol, operands, attrs, types = c
        return RawOp(results or [], str(name), unquote_symbol(symbol) if symbol else None, operands,
                     attrs or {}, types or [], meta.line, meta.column)

    def arg(self, c):
        return c[0], c[1], c[2] or {}

    def func_args(self, c):
        return list(c)

    def result(self, c):
        return c[0], c[1] or {}

    def func_results(self, c):
        return [r for r in c if r is not None]

    def role(self, c):
        return str(c[0])

    def ret(self, c):
        return c[1] or [], (c[0].line, c[0].column)

    @v_args(meta=True)
    def func(self, meta, c):
        name, args, results, role, attrs, *body = c
        ret, ret_loc = body.pop()
        return RawFunc(str(name), args or [], results or [], role, attrs or {}, body, ret, meta.line, meta.column,
                       meta.end_line, ret_loc)

    @v_args(meta=True)
    def decl(self, meta, c):
        kind, name, typ, attrs = c
        return Decl(str(kind), unquote_symbol(name), typ, attrs or {}, (meta.line, meta.column)), name

    @v_args(meta=True)
    def module(self, meta, c):
        name, attrs, *items = c
        return name, attrs or {}, items, (meta.line, meta.column)

    def start(self, c):
        return c[0]


class _SemanticError(Exception):
    def __init__(self, message: str, token):
        super().__init__(message)
        self.token = token  # a Token or a _Span: where to point


class _Span(str):
    """Where a tree node lies, shaped like a Token for the diagnostic (line, column, length)."""

    def __new__(cls, meta):
        span = super().__new__(cls, " " * max(1, meta.end_pos - meta.start_pos))
        span.line, span.column = meta.line, meta.column
        return span


# ``none`` as an attribute value, told apart from an absent value (a unit attribute)
# until _ToRaw.attr has seen both.
_NONE_ATTR = object()


# ---- the fast path (dcir/fast_parse.py) ---------------------------------------------

def _template_op(template: str) -> RawOp | None:
    """A template op line parsed with the grammar's ``op`` rule; None when it does not
    parse alone (the full grammar then reports it in context)."""
    try:
        return _ToRaw().transform(_lark().parse(template, start="op"))
    except (UnexpectedInput, _SemanticError, VisitError):
        return None


_TEMPLATES = fast_parse.Templates(_template_op)


@lru_cache(maxsize=1)
def _terminals() -> tuple[str, str, str]:
    terms = {t.name: t.pattern.to_regexp() for t in _lark().terminals}
    return terms["VALUE"], terms["OP_NAME"], terms["SYMBOL"]


def _instantiate(tpl: RawOp, names: list[str], symbols: list[str], line: int, col: int) -> RawOp:
    n = len(tpl.results)
    return RawOp(names[:n], tpl.name, symbols[0][1:] if symbols else None,
                 None if tpl.operands is None else names[n:], tpl.attrs, tpl.types, line, col)


# ---- building the module -------------------------------------------------------------

def parse(text: str, name: str = "<string>", *, fast: bool = True, line_offset: int = 0) -> Module:
    """Parse DCIR text into a ``Module``. Raises ``DcirError`` with a located diagnostic.

    ``line_offset`` shifts reported line numbers (a chunk of a ``--split-input-file``).
    """
    # Building a module allocates a few objects per op and frees none: the cyclic
    # garbage collector would only rescan them, costing about a third of the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse(text, name, fast, line_offset)
    finally:
        if enabled:
            gc.enable()


def _parse(text: str, name: str, fast: bool, line_offset: int) -> Module:
    source = Source(name, text, line_offset)
    lines = text.split("\n")
    fast_ops = fast_parse.candidates(lines, _TEMPLATES, _terminals(), _instantiate) if fast else {}
    while True:
        skeleton = "\n".join("" if i in fast_ops else line for i, line in enumerate(lines)) if fast_ops else text
        try:
            tree = _lark().parse(skeleton, start="start")
            mod_name, attrs, items, loc = _ToRaw().transform(tree)
            break
        except UnexpectedInput as e:
            fast_line = fast_parse.continued_line(getattr(e, "line", None), e.column, lines, fast_ops)
            if fast_line is None:
                raise DcirError(_syntax_diagnostic(e, source, skeleton)) from None
            del fast_ops[fast_line]  # an op that goes on in the next line: give it back to the grammar
        except VisitError as e:  # Lark wraps errors raised in transformer callbacks
            if isinstance(e.orig_exc, _SemanticError):
                raise DcirError(_token_diag(source, e.orig_exc.token, str(e.orig_exc))) from None
            raise
    funcs = [x for x in items if isinstance(x, RawFunc)]
    by_line = fast_parse.assign(funcs, fast_ops)
    if by_line is None:  # the fast path's view of the text was wrong: let the full grammar judge it
        return _parse(text, name, False, line_offset)
    module = Module(unquote_symbol(mod_name), attrs=attrs, loc=_shift(loc, line_offset), source=source)
    diags: list[Diagnostic] = []
    for item in items:
        if isinstance(item, tuple):
            decl, tok = item
            decl.loc = _shift(decl.loc, line_offset)
            if decl.name in module.decls:
                diags.append(Diagnostic(f"redefinition of symbol @{decl.name}", source, decl.loc, len(tok),
                                        (Note(module.decls[decl.name].loc, "previous definition here"),)))
                continue
            module.decls[decl.name] = decl
    for raw, ops in zip(funcs, by_line):
        func = _build_function(raw, ops, source)
        if func.name in module.functions:
            diags.append(Diagnostic(f"redefinition of function @{func.name}", source, func.loc, 4,
                                    (Note(module.functions[func.name].loc, "previous definition here"),)))
            continue
        module.functions[func.name] = func
    libraries = attrs.get(custom_ops.LIBRARIES)
    if isinstance(libraries, tuple) and all(map(custom_ops.is_module_name, libraries)):  # else the verifier says
        if why := custom_ops.load_libraries(libraries):
            diags.append(Diagnostic(
                f"the custom ops of @{module.name} are registered by the Python modules its attribute "
                f"'{custom_ops.LIBRARIES}' names, and {why}; put the module on the path (PYTHONPATH), or drop the "
                "attribute and import the library with --load", source, module.loc, 6))
    if diags:
        raise DcirError(diags)
    return module


def _shift(loc, offset):
    return None if loc is None else (loc[0] + offset, loc[1])


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _build_function(raw: RawFunc, raw_ops: list[RawOp], source: Source) -> Function:
    off = source.line_offset
    # All definitions first, so a use before its definition resolves to it (the
    # verifier reports the order); a name never defined gets an ownerless value.
    # Each op is then built once, with its operands resolved (which records their uses).
    later: dict[str, Value] = {}
    args = [Value(str(tok)[1:], typ) for tok, typ, _ in raw.args]
    defined = []
    for r in raw_ops:
        if len(r.types) != len(r.results):
            raise DcirError(Diagnostic(
                f"{r.name} defines {_count(len(r.results), 'result')} but declares {_count(len(r.types), 'type')}",
                source, (r.line + off, r.col), len(r.name) if not r.results else len(r.results[0])))
        results = [Value(str(n)[1:], t) for n, t in zip(r.results, r.types)]
        defined.append(results)
        for v in results:
            later.setdefault(v.name, v)
    current: dict[str, Value] = {}
    for a in args:
        current.setdefault(a.name, a)
        later.setdefault(a.name, a)
    undefined: dict[str, Value] = {}

    def resolve(name: str) -> Value:
        v = current.get(name) or later.get(name) or undefined.get(name)
        if v is None:
            v = undefined[name] = Value(name, None)
        return v

    ops = []
    for r, results in zip(raw_ops, defined):
        ops.append(Op(r.name, [resolve(str(n)[1:]) for n in (r.operands or ())], results, dict(r.attrs), r.symbol,
                      (r.line + off, r.col), r.operands is not None))
        for v in results:
            current[v.name] = v
    return Function(unquote_symbol(raw.name), args, [t for t, _ in raw.results], ops,
                    [resolve(str(n)[1:]) for n in raw.ret], raw.attrs, (raw.line + off, raw.col),
                    (raw.ret_loc[0] + off, raw.ret_loc[1]), raw.role, [d for _, _, d in raw.args],
                    [d for _, d in raw.results])


# ---- syntax diagnostics --------------------------------------------------------------

_TERMINAL_NAMES = {
    "VALUE": "a value (%name)", "SYMBOL": "a symbol (@name)", "OP_NAME": "an op name (family.op)",
    "TENSOR_TYPE": "a tensor type (f32[8, 16])", "ATTR_KEY": "an attribute name", "INT": "an integer",
    "FLOAT": "a number", "STRING": "a string", "DTYPE": "an element type", "DECL_KIND": "'param' or 'buffer'",
    "RETURN": "'return'", "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('", "RPAR": "')'", "LSQB": "'['",
    "RSQB": "']'", "COMMA": "','", "COLON": "':'", "EQUAL": "'='", "LESSTHAN": "'<'", "MORETHAN": "'>'",
    "__ANON_0": "'->'", "MODULE": "'module'", "FUNC": "'func'", "ATTRIBUTES": "'attributes'", "ROLE": "'role'",
    "SHARD": "'shard'", "PENDING": "'pending'", "HOST": "'host'", "NONE": "'none'", "TRUE": "'true'",
    "FALSE": "'false'", "$END": "the end of the file", "<END-OF-FILE>": "the end of the file",
}

# Common mistakes, as rows of (when, message). ``when`` sees the offending token's type,
# the set of terminals the parser expected there, and the source line. Lark's
# ``match_examples`` matches on exact LALR states, and this grammar's optional parts
# give the same mistake different states (a function with arguments or without), so
# the rows test the expected terminals instead, which are the same in all of them.
_TYPE_START = {"TENSOR_TYPE", "SHARD", "PENDING", "HOST", "NONE"}
# A keyword out of place is lexed as a bare word (ATTR_KEY); this names it again.
_KEYWORD_TYPES = {"param": "DECL_KIND", "buffer": "DECL_KIND", "func": "FUNC", "return": "RETURN", "module": "MODULE"}
_MISTAKES = [
    (lambda tok, exp, line: "COLON" in exp and line.lstrip().startswith(("param ", "buffer ")),
     "a declaration is `param @name : type` or `buffer @name : type`"),
    (lambda tok, exp, line: tok == "RBRACE" and "RETURN" in exp,
     "a function body must end with 'return' (even one that returns nothing)"),
    (lambda tok, exp, line: "RBRACE" in exp and exp <= {"COMMA", "RBRACE", "VALUE"}
     and (tok in ("EQUAL", "OP_NAME") or (tok == "VALUE" and "=" in line)),
     "'return' must be the last op of its function"),
    (lambda tok, exp, line: exp == {"COLON"},
     "function arguments are written %name: type"),
    (lambda tok, exp, line: tok == "VALUE" and {"COMMA", "RPAR"} <= exp,
     "operands are separated by ','"),
    (lambda tok, exp, line: tok in _TYPE_START and "COLON" in exp,
     "result types follow ':' after the operands, e.g. `%y = aten.relu.default(%x) : f32[4]`"),
    (lambda tok, exp, line: "EQUAL" in exp and "RBRACE" in exp and tok != "EQUAL",
     "attributes are written {name = value, ...}"),
    (lambda tok, exp, line: exp == {"MODULE"},
     "a module starts with `module @name {`"),
    (lambda tok, exp, line: tok == "DECL_KIND" and "FUNC" in exp,
     "declarations (param, buffer) come before the functions"),
]


def _expected(names) -> str:
    shown = sorted({_TERMINAL_NAMES.get(n, n) for n in names})
    return ", ".join(shown)


def _token_diag(source: Source, tok, message: str) -> Diagnostic:
    if tok is None or getattr(tok, "line", None) is None:
        return Diagnostic(message, source, None)
    return Diagnostic(message, source, (tok.line + source.line_offset, tok.column), max(1, len(str(tok))))


_TYPE_LIKE = re.compile(r"[A-Za-z_]\w*(\[[^\]\n]*\]|<)")  # float32[4], tensor<
_NAME_LIKE = re.compile(r"[A-Za-z_][\w.$-]*")


def _syntax_diagnostic(e: UnexpectedInput, source: Source, skeleton: str) -> Diagnostic:
    line, col = e.line + source.line_offset, e.column
    if isinstance(e, UnexpectedCharacters):
        return Diagnostic(_characters_message(e, skeleton), source, (line, col), _word_len(skeleton, e.pos_in_stream))
    if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
        lines = source.text.rstrip("\n").split("\n")  # the text, not the skeleton: its ops are blanked
        last = (len(lines) + source.line_offset, len(lines[-1]) + 1)
        missing = "a '}' is missing" if "RBRACE" in getattr(e, "expected", ()) else "the module is incomplete"
        return Diagnostic(f"unexpected end of file: {missing}", source, last, 1)
    tok = e.token
    expected = set(e.accepts or e.expected)
    text = source.line(line)
    kind = _KEYWORD_TYPES.get(str(tok), tok.type) if tok.type == "ATTR_KEY" else tok.type
    message = next((msg for when, msg in _MISTAKES if when(kind, expected, text)), None)
    if message is None and tok.type == "ATTR_KEY":  # a bare word where the parser wanted something else
        message, length = _word_message(str(tok), expected, skeleton[tok.start_pos:])
        return Diagnostic(message, source, (line, col), length)
    if message is None:
        message = f"unexpected {_describe(tok)}; expected {_expected(expected)}"
    return Diagnostic(message, source, (line, col), max(1, len(str(tok))))


def _describe(tok: Token) -> str:
    if tok.type in ("VALUE", "SYMBOL", "OP_NAME", "TENSOR_TYPE", "ATTR_KEY", "INT", "FLOAT", "STRING", "DTYPE"):
        kind = _TERMINAL_NAMES[tok.type].split(" (")[0].split(" ", 1)[1]  # "a value (%name)" -> "value"
        return f"{kind} '{tok}'"
    return f"'{tok}'"


def _word_len(text: str, pos: int) -> int:
    m = re.compile(r"[^\s(){}\[\],:=<>]+").match(text, pos)
    return len(m.group()) if m else 1


def _characters_message(e: UnexpectedCharacters, text: str) -> str:
    allowed = set(e.allowed or ())
    rest = text[e.pos_in_stream:]
    if _NAME_LIKE.match(rest):
        return _word_message(rest[:_word_len(text, e.pos_in_stream)], allowed, rest)[0]
    if rest.startswith("%"):
        return "malformed value name: % is followed by a letter, digit, _ or $ (then also . and -)"
    if rest.startswith("@") and not rest.startswith('@"'):
        return "malformed symbol name: @ is followed by a letter, _ or $ (then also digits, . and -), or by a JSON string"
    if rest.startswith(('"', '@"')):
        return "malformed string: strings are JSON strings on one line (escapes \\\" \\\\ \\n \\t \\uXXXX ...)"
    return f"unexpected character {rest[:1]!r}; expected {_expected(allowed)}"


def _word_message(word: str, allowed: set, rest: str) -> tuple[str, int]:
    """What to say about a bare word where the parser expected ``allowed``, and how
    many characters to underline."""
    typ = _TYPE_LIKE.match(rest)
    if "TENSOR_TYPE" in allowed and typ:
        word = typ.group().rstrip("<")
        return (f"unknown type '{word}'; tensor types are written like f32[8, 16] "
                f"(element types: {', '.join(DTYPE_BYTES)}), or shard<...>, pending<...>, host<...>, none"), len(word)
    if "OP_NAME" in allowed and "." not in word:
        message = f"unexpected '{word}': value names start with '%', and op names are written family.op (e.g. aten.relu.default)"
    elif "VALUE" in allowed:
        message = f"value names start with '%': write %{word}"
    elif "SYMBOL" in allowed:
        message = f"symbol names start with '@': write @{word}"
    else:
        message = f"unexpected '{word}'; expected {_expected(allowed)}"
    return message, len(word)
