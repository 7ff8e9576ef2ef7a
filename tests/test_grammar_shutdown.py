"""A worker's grammar threads never hold up its exit: with a compilation stuck in the grammar
engine (a build seam blocked on an event that is never set), ``shutdown`` returns and the process
exits, and every grammar thread is a daemon."""

from __future__ import annotations

import subprocess
import sys
import textwrap

GUARD_S = 120  # a hang guard, never a bound: the child exits at once when the code is right

CHILD = textwrap.dedent("""
    import threading
    from splitserve.engine.grammar import GrammarSpec
    from splitserve.engine.grammar_compiler import GrammarCompiler
    from splitserve.models.loader import load_tokenizer
    from splitserve.testing.tiny import tiny_model_path

    began, never = threading.Event(), threading.Event()

    def build(spec, lltok):
        began.set()
        never.wait()
        return None, "unreached"

    tok = load_tokenizer(tiny_model_path())
    c = GrammarCompiler(build=build, timeout_s=0.05)
    c.prepare(tok, len(tok))
    threading.Thread(target=c.compile, args=(GrammarSpec("regex", "a+"),), daemon=True).start()
    assert began.wait(60)
    c.shutdown()
    held = [t.name for t in threading.enumerate() if t.name.startswith("grammar-") and not t.daemon]
    print("non-daemon grammar threads:", len(held), flush=True)
""")


def test_exit_does_not_wait_for_a_stuck_compilation():
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=GUARD_S)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "non-daemon grammar threads: 0" in child.stdout
