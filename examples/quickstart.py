"""hutch in one minute: a microVM sandbox from Python.

    hutch keys create            # prints a key; export it as HUTCH_API_KEY
    hutch serve &                # http://127.0.0.1:3000 (HUTCH_API_URL)
    python examples/quickstart.py
"""

from hutch import CommandExitError, Sandbox

with Sandbox.create(metadata={"example": "quickstart"}) as sbx:
    print(f"sandbox {sbx.sandbox_id} is up")

    # Output streams while the command runs.
    sbx.commands.run("for i in 1 2 3; do echo tick $i; sleep 0.2; done", on_stdout=lambda s: print("  >", s, end=""))

    # Files go in and out; the code runs in the guest's own kernel.
    sbx.files.write("/home/user/script.py", "import platform\nprint('hello from', platform.release())\n")
    print(sbx.commands.run("python3 /home/user/script.py").stdout, end="")
    print("files:", [e.name for e in sbx.files.list("/home/user") if e.type == "file"])

    # A failing command raises, with its output attached.
    try:
        sbx.commands.run("echo 'no such thing' >&2; exit 3")
    except CommandExitError as e:
        print(f"exit code {e.exit_code}: {e.stderr.strip()}")
print("sandbox killed")
