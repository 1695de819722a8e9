"""The test harness the "code" reward runs inside its jail, as ``python3 -I -S -c <this file's source>``.

What this is: two processes that never share an interpreter. The harness
process (here, "H") makes itself non-dumpable, then forks the solution
process ("S") *before* it reads the job, so S's memory never holds the job,
the tests or the nonce. S takes stdin from /dev/null and writes its prints
to stderr; all it keeps is one pipe pair to H. (S gets the tests' import
statements, run after the solution as if beside it; nothing else of them.) H then reads the job from
stdin, writes the ``ready`` record (before any solution code runs), hands S
the code and runs every test itself. A name the solution defines reaches the
tests as plain data (exact built-in types, decoded afresh) or as a proxy
whose calls, attribute reads, iteration, ``len``, indexing, ``in``, ``bool``
and ``str`` are answered by S over the pipe; equality is never asked of S,
and a solution name that shadows a built-in (``abs``, ``isinstance``, ...)
does not reach the tests.
Only H writes records, to stdout, nonce-tagged: S holds no descriptor of
that stream, cannot read H's memory or descriptors (H is non-dumpable, so
``/proc/H/fd``, ``/proc/H/mem``, ptrace and process_vm_readv are refused to
it), and never learns the nonce. What S controls is the values it returns,
which is what is being graded. If S exits, hangs or breaks the protocol,
the tests still waiting fail.

What this is not: the jail (rlctl_rewards.sandbox) or the judge
(rlctl_rewards.code, which compares value tests outside the jail). It runs
only inside the jail; importing it runs nothing.
"""

import builtins
import json
import os
import sys

_MAX_REPLY = 64 << 20  # bytes of one answer from the solution process
_PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)


def enc(value, ref, depth=0):
    """JSON form of plain built-in data (exact types only); other values go to ``ref`` (None: not plain)."""
    kind = type(value)
    if depth > 50:
        return None
    if kind not in _PLAIN:
        return ref(value) if ref is not None else None
    if value is None or kind is bool or kind is str:
        return [kind.__name__, value]
    if kind is int:
        return ["int", str(value)] if abs(value) < 10**4000 else (ref(value) if ref is not None else None)
    if kind is float:
        return ["float", repr(value)]
    if kind is complex:
        return ["complex", [repr(value.real), repr(value.imag)]]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        items = [enc(v, ref, depth + 1) for v in value]
        if any(i is None for i in items):
            return None
        return [kind.__name__, sorted(json.dumps(i) for i in items) if kind in (set, frozenset) else items]
    pairs = [(enc(k, ref, depth + 1), enc(v, ref, depth + 1)) for k, v in value.items()]
    if any(k is None or v is None for k, v in pairs):
        return None
    return ["dict", [[json.dumps(k), v] for k, v in pairs]]  # insertion order: a dict's order is part of its value


def canon(form):
    """An ``enc`` form with every dict's pairs in key order: two forms of equal values compare equal."""
    if isinstance(form, list) and len(form) == 2 and form[0] in ("list", "tuple") and isinstance(form[1], list):
        return [form[0], [canon(item) for item in form[1]]]
    if isinstance(form, list) and len(form) == 2 and form[0] == "dict" and isinstance(form[1], list):
        return ["dict", sorted([pair[0], canon(pair[1])] for pair in form[1])]
    return form


def dec(form, deref, depth=0):
    """The value ``enc`` encoded; ``deref(k)`` resolves ``["ref", k]``. Raises ValueError on anything else."""
    if depth > 60 or not isinstance(form, list) or len(form) != 2 or not isinstance(form[0], str):
        raise ValueError("malformed value")
    kind, body = form
    if kind == "NoneType":
        return None
    if kind in ("bool", "str") and type(body).__name__ == kind:
        return body
    if kind == "int" and isinstance(body, str):
        return int(body)
    if kind == "float" and isinstance(body, str):
        return float(body)
    if kind == "complex" and isinstance(body, list) and len(body) == 2:
        return complex(float(body[0]), float(body[1]))
    if kind == "bytes" and isinstance(body, str):
        return bytes.fromhex(body)
    if kind in ("list", "tuple") and isinstance(body, list):
        items = [dec(v, deref, depth + 1) for v in body]
        return items if kind == "list" else tuple(items)
    if kind in ("set", "frozenset") and isinstance(body, list):
        items = [dec(json.loads(v), deref, depth + 1) for v in body]
        return set(items) if kind == "set" else frozenset(items)
    if kind == "dict" and isinstance(body, list):
        return {dec(json.loads(k), deref, depth + 1): dec(v, deref, depth + 1) for k, v in body}
    if kind == "ref" and isinstance(body, int):
        return deref(body)
    raise ValueError(f"malformed value of kind {kind[:20]!r}")


def why(err):
    try:
        return (type(err).__name__ + ": " + str(err))[:300]
    except BaseException:
        return type(err).__name__


# -- S: the solution process -------------------------------------------------------------------

_OPS = {
    "call": lambda obj, args, kw: obj(*args, **kw),
    "getattr": lambda obj, args, kw: getattr(obj, *args),
    "list": lambda obj, args, kw: list(obj),
    "len": lambda obj, args, kw: len(obj),
    "getitem": lambda obj, args, kw: obj[args[0]],
    "contains": lambda obj, args, kw: args[0] in obj,
    "bool": lambda obj, args, kw: bool(obj),
    "str": lambda obj, args, kw: str(obj),
}


def serve_solution(rfd, wfd):
    """Run the solution, then answer H's requests on its objects until H closes the pipe; never returns."""
    inp, out = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")
    objs = []

    def ref(value):
        objs.append(value)
        return ["ref", len(objs) - 1]

    def form(value):  # plain data, else a handle the tests can call through
        encoded = enc(value, ref)
        return encoded if encoded is not None else ref(value)

    def send(message):
        for stream in (sys.stdout, sys.stderr):  # the solution's prints are evidence: never lose them
            try:
                stream.flush()
            except BaseException:
                pass
        out.write((json.dumps(message) + "\n").encode())
        out.flush()

    job = json.loads(inp.readline())
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(job["code"], "solution.py", "exec"), ns)
        try:  # the tests' imports, as the solution would have seen them beside the tests
            exec(compile(job["imports"], "tests.py", "exec"), ns)
        except Exception:
            pass
        send({"names": {k: form(v) for k, v in list(ns.items()) if not k.startswith("__")}})
    except BaseException as err:
        send({"raise": ["", "solution raised " + why(err)]})
        os._exit(0)
    while line := inp.readline():
        try:
            req = json.loads(line)
            args = dec(req["args"], objs.__getitem__)
            kw = dec(req["kw"], objs.__getitem__)
            send({"ok": form(_OPS[req["op"]](objs[req["ref"]], args, kw))})
        except BaseException as err:
            send({"raise": [type(err).__name__, why(err)[len(type(err).__name__) + 2:]]})
    os._exit(0)


# -- H: the harness process --------------------------------------------------------------------


class SolutionGone(BaseException):
    """The solution process ended or broke the protocol; every test still waiting fails.

    A BaseException, so a test's own ``except Exception`` cannot swallow it."""


class Solution:
    """H's end of the pipe pair: one request, one answer."""

    def __init__(self, pid, wfd, rfd):
        self.pid, self.out, self.inp = pid, os.fdopen(wfd, "wb"), os.fdopen(rfd, "rb")
        self.gone = None

    def answer(self):
        line = self.inp.readline(_MAX_REPLY)
        if not line.endswith(b"\n"):
            self.gone = "the solution process ended" if not line else "the solution's answer is too large"
            raise SolutionGone(self.gone)
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or len(reply) != 1:
            self.gone = "the solution process broke the harness protocol"
            raise SolutionGone(self.gone)
        return reply

    def ask(self, op, k, args=(), kw=None):
        if self.gone:
            raise SolutionGone(self.gone)
        request = {"op": op, "ref": k, "args": _arg(list(args)), "kw": _arg(dict(kw or {}))}
        try:
            self.out.write((json.dumps(request) + "\n").encode())
            self.out.flush()
        except OSError:
            self.gone = "the solution process ended"
            raise SolutionGone(self.gone) from None
        reply = self.answer()
        if "raise" in reply:
            name, message = reply["raise"] if isinstance(reply["raise"], list) else ("", "?")
            kind = getattr(builtins, str(name), None)
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = SolutionError
            try:
                err = kind(str(message)[:300])
            except Exception:
                err = SolutionError(f"{name}: {message}"[:300])
            raise err
        return _value(reply.get("ok"))


class SolutionError(Exception):
    """The solution raised an exception that is not a built-in one."""


class Remote:
    """A solution object: its behaviour is asked of the solution process; equality stays identity."""

    __slots__ = ("_k",)

    def __init__(self, k):
        object.__setattr__(self, "_k", k)

    def __call__(self, *args, **kw):
        return SOLUTION.ask("call", self._k, args, kw)

    def __getattr__(self, name):
        return SOLUTION.ask("getattr", self._k, (name,))

    def __iter__(self):
        return iter(SOLUTION.ask("list", self._k))

    def __len__(self):
        return SOLUTION.ask("len", self._k)

    def __getitem__(self, key):
        return SOLUTION.ask("getitem", self._k, (key,))

    def __contains__(self, item):
        return SOLUTION.ask("contains", self._k, (item,))

    def __bool__(self):
        return SOLUTION.ask("bool", self._k) is True

    def __str__(self):
        return str(SOLUTION.ask("str", self._k))

    def __repr__(self):
        return f"<solution object {self._k}>"


SOLUTION = None


def _arg(value):
    form = enc(value, lambda v: ["ref", v._k] if type(v) is Remote else None)
    if form is None:
        raise TypeError("only plain data and the solution's own objects can be passed to the solution")
    return form


def _value(form):
    try:
        return dec(form, Remote)
    except (ValueError, TypeError, RecursionError, OverflowError) as err:
        raise SolutionGone(f"the solution sent a malformed value ({why(err)})") from None


def same(a, b):
    """``==`` for plain data with exact types (numbers by value); solution objects only equal themselves."""
    num = (int, float)
    if type(a) in num and type(b) in num:
        return a == b
    ea, eb = enc(a, None), enc(b, None)
    if ea is not None and eb is not None:
        return canon(ea) == canon(eb)
    return a is b


def run_tests(job, names, rec):
    ns = {"__name__": "tests", "__builtins__": builtins, **names, "__rlctl_same__": same}
    try:
        exec(compile(job["setup"], "tests.py", "exec"), ns)
        broken = None
    except BaseException as err:
        broken = "test setup raised " + why(err)
    for i, test in enumerate(job["tests"]):
        if broken is not None or SOLUTION.gone:
            rec(i=i, ok=False, error=broken or SOLUTION.gone)
            continue
        ns["__rlctl_same__"] = same
        try:
            if test["kind"] == "value":
                form = enc(eval(compile(test["src"], "tests.py", "eval"), ns), None)
                if form is None:
                    rec(i=i, ok=False, error="value is not plain built-in data")
                else:
                    rec(i=i, ok=True, value=form)
            elif test["kind"] == "assert":
                exec(compile(test["src"], "tests.py", "exec"), ns)
                rec(i=i, ok=True)
            else:
                ns[test["src"]]()
                rec(i=i, ok=True)
        except BaseException as err:
            rec(i=i, ok=False, error=why(err))


def main():
    global SOLUTION
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
        os._exit(126)  # fail closed: no records, so the judge reports a harness that never started
    call_r, call_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # S may read its own /proc/self; H stays closed to it
            os.close(call_w)
            os.close(reply_r)
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(2, 1)
            os.close(null)
            serve_solution(call_r, reply_w)
        finally:
            os._exit(0)
    os.close(call_r)
    os.close(reply_w)
    job = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    nonce, write = job["nonce"], os.write

    def rec(**record):
        record["n"] = nonce
        write(1, (json.dumps(record) + "\n").encode())

    rec(ready=True)
    SOLUTION = Solution(pid, call_w, reply_r)
    try:
        SOLUTION.out.write((json.dumps({"code": job["code"], "imports": job["imports"]}) + "\n").encode())
        SOLUTION.out.flush()
        loaded = SOLUTION.answer()
    except (OSError, SolutionGone) as err:
        loaded = {"raise": ["", SOLUTION.gone or why(err)]}
    if "raise" in loaded or not isinstance(loaded.get("names"), dict):
        SOLUTION.gone = str(loaded.get("raise", ["", "the solution process broke the harness protocol"])[-1])[:300]
        names = {}
    else:
        names = {}
        for name, form in loaded["names"].items():
            if str(name) in vars(builtins):  # the tests' abs, len, isinstance, ... stay the real ones
                continue
            try:
                names[str(name)] = _value(form)
            except SolutionGone as err:
                SOLUTION.gone = str(err)
    run_tests(job, names, rec)
    rec(done=True)
    try:  # end S now: much faster than leaving it to the PID namespace's teardown
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
