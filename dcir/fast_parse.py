"""The parser's fast path: op lines parsed once per *shape*, not once per line.

Why it exists: Lark's pure-Python lexer costs ~10 us a token, and a real module is
large (an 80-layer model's training step has ~100k ops). The full grammar alone
parses the 93,701-op benchmark module (``benchmarks/bench_compiler.py``) in ~5.5 s,
over the whole 5 s budget for parse, verify and print; with this path, ~0.55 s. The
ops of a module repeat a few hundred shapes with different value names, so:

1. In a function body, a line that holds exactly one complete op is a *candidate*:
   ``[%r, ... =] family.op [@symbol][(%a, ...)] [{attrs}] [: types]`` on one line,
   brackets balanced, outside any other op, no string literal holding ``%`` or ``@``,
   and not continued on the next line (one that starts with ``:``, ``{``, ``,`` ...).
2. Its value names and its one bare symbol are replaced by placeholders, and that
   *template* is parsed with the grammar's own ``op`` rule (the real Lark parser,
   once per distinct template); the line's names are put back in.
3. The caller blanks the candidate lines (newlines kept, so positions stay right) and
   parses the rest, the skeleton, with the full grammar, which still accepts any op
   on any number of lines.

What it accepts is therefore exactly what the grammar accepts: a template that does
not parse leaves its line to the full grammar, which reports any error in context;
a candidate the skeleton shows to be part of a longer op is handed back
(``continued_line``). ``dcir.parse(text, fast=False)`` skips this path;
``tests/test_parser.py`` checks that both paths give structurally identical modules,
and errors at the same place, on every golden file and snapshot.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable

_FUNC_HEADER = re.compile(r"[ \t]*func[ \t]")
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')  # only to blank strings out when counting brackets
_PLACEHOLDER = "%_"
_SYMBOL_PLACEHOLDER = "@_"
_CONTINUATION = (":", "{", "(", ",", "@", "=", "[", "<", "->")
_BARE_SYMBOL = r"@[A-Za-z_$][\w.$-]*"  # quoted symbols (with '"') are left to the grammar


@lru_cache(maxsize=4)
def patterns(value: str, op_name: str, symbol: str) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """The value-name, op-line and bare-symbol patterns, built from the grammar's own
    terminals (given as regexps) so the fast path can never accept a name the
    grammar rejects."""
    op_line = rf"[ \t]*(?:{value}[ \t]*(?:,[ \t]*{value}[ \t]*)*=[ \t]*)?{op_name}"
    assert re.fullmatch(symbol, "@a.b$-1"), "SYMBOL terminal changed: update _BARE_SYMBOL"
    return re.compile(value), re.compile(op_line), re.compile(_BARE_SYMBOL)


class Templates:
    """Op templates parsed so far: template text -> the parsed op (None: it does not
    parse alone, so the full grammar gets the line)."""

    LIMIT = 50_000  # distinct op shapes kept; a long-lived process starts over past this

    def __init__(self, parse_op: Callable[[str], object]):
        self.parse_op = parse_op  # template -> raw op, or None when it does not parse
        self.cache: dict[str, object] = {}

    def get(self, template: str):
        try:
            return self.cache[template]
        except KeyError:
            pass
        if len(self.cache) >= self.LIMIT:
            self.cache.clear()
        op = self.cache[template] = self.parse_op(template)
        return op


def candidates(lines: list[str], templates: Templates, terminals: tuple[str, str, str],
               instantiate: Callable) -> dict[int, object]:
    """Op lines parsed from templates, by 0-based line index (see the module docstring).
    ``instantiate(template_op, names, symbols, line, col)`` makes the line's own op."""
    value_re, op_line_re, symbol_re = patterns(*terminals)
    found: dict[int, object] = {}
    in_body, depth = False, 0
    previous = ""  # the last line of code before this one, stripped
    for i, line in enumerate(lines):
        if not in_body:
            in_body, depth, previous = _opens_body(line), 0, "{"
            continue
        code, blanked = _code(line) if ('"' in line or "//" in line) else (line, line)
        # A line whose template parses as one whole op is balanced (the grammar pairs
        # every bracket), so brackets are counted only on the other lines.
        whole = depth == 0 and not previous.endswith((",", "="))  # not inside, nor continuing, another op
        if whole and op_line_re.match(code) and _plain_strings(code, blanked):
            names, symbols = value_re.findall(code), symbol_re.findall(code)
            tpl = templates.get(symbol_re.sub(_SYMBOL_PLACEHOLDER, value_re.sub(_PLACEHOLDER, code)))
            if (tpl is not None and len(names) == len(tpl.results) + len(tpl.operands or ())
                    and (tpl.symbol == "_" if symbols else tpl.symbol is None) and len(symbols) <= 1):
                found[i] = instantiate(tpl, names, symbols, i + 1, len(code) - len(code.lstrip()) + 1)
                previous = ""  # a complete op: it ends neither with ',' nor with '='
                continue
        opens, closes = _brackets(blanked)
        previous = blanked.strip() or previous
        depth += opens - closes
        in_body = depth >= 0
    return {i: op for i, op in found.items() if not _continues(lines, i)}


def _opens_body(line: str) -> bool:
    """Whether ``line`` is a function header whose body starts after it."""
    if not _FUNC_HEADER.match(line):
        return False
    _, blanked = _code(line)
    opens, closes = _brackets(blanked)
    return opens - closes == 1 and blanked.rstrip().endswith("{")


def _brackets(code: str) -> tuple[int, int]:
    opens = code.count("(") + code.count("[") + code.count("{")
    closes = code.count(")") + code.count("]") + code.count("}")
    return opens, closes


def _blank(m: re.Match) -> str:
    return '"' + " " * (len(m.group()) - 2) + '"'


def _code(line: str) -> tuple[str, str]:
    """The line without its comment, and the same with string contents blanked (same
    length, for bracket counting and finding the comment)."""
    blanked = _STRING.sub(_blank, line) if '"' in line else line
    cut = blanked.find("//")
    if cut < 0:
        return line, blanked
    return line[:cut], blanked[:cut]


def _plain_strings(code: str, blanked: str) -> bool:
    """No string literal on the line holds text the templating would touch."""
    if code is blanked:
        return True
    return not any(c in m for m in _STRING.findall(code) for c in "%@")


def no_code(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("//")


def _continues(lines: list[str], i: int) -> bool:
    """Whether the code after line ``i`` goes on with the op on it (``: f32[4]`` on the
    next line): then that line is not a whole op, and the grammar must see it."""
    j = i + 1
    while j < len(lines) and no_code(lines[j]):
        j += 1
    return j < len(lines) and lines[j].lstrip().startswith(_CONTINUATION)


def continued_line(line: int | None, column: int, lines: list[str], fast_ops: dict) -> int | None:
    """The fast-path line that a syntax error at 1-based (``line``, ``column``) may
    belong to: a complete-looking op line whose op goes on past a comment the
    look-ahead did not expect. None when the error is elsewhere."""
    if not fast_ops or not isinstance(line, int) or line < 1:
        return None
    if lines[line - 1][:column - 1].strip():
        return None  # the error is not where a line starts
    i = line - 2
    while i >= 0 and no_code(lines[i]):
        i -= 1
    return i if i in fast_ops else None


def assign(funcs: list, fast_ops: dict[int, object]) -> list[list] | None:
    """Each function's ops (from the skeleton and the fast path), in text order; None
    when a fast-path op is not between its function's header and its return."""
    per_func = [list(f.ops) for f in funcs]
    if not fast_ops:
        return per_func
    k = 0
    for idx in sorted(fast_ops):
        lineno = idx + 1
        while k < len(funcs) and funcs[k].end_line < lineno:
            k += 1
        if k == len(funcs) or not funcs[k].line < lineno < funcs[k].ret_loc[0]:
            return None
        per_func[k].append(fast_ops[idx])
    for ops in per_func:
        ops.sort(key=lambda o: (o.line, o.col))
    return per_func
