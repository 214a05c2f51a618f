"""hutch's Java kernel, inside the code-interpreter guest: a Jupyter kernel (ipykernel's
base, as bash_kernel is) over jshell's engine in a JVM of its own (HutchJShell.java),
because no packaged Java kernel is reachable from the registries hutch builds from.
The JVM talks frames ("KIND LENGTH\\n" + UTF-8 payload) over its stdin and stdout."""

import codecs
import queue
import subprocess
import threading

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

JAVA_CLASSES = "/usr/lib/hutch/java"
# Client VM flags for a small guest: C1 only and the serial collector start faster and
# take less memory than the server defaults; jshell's compiler dominates either way.
JVM = ["java", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xss4m", "-cp", JAVA_CLASSES, "HutchJShell"]


class JavaKernel(Kernel):
    implementation = "hutch-java"
    implementation_version = "1"
    language = "java"
    language_version = "17"
    language_info = {"name": "java", "mimetype": "text/x-java", "file_extension": ".java"}
    banner = "Java (jshell), hutch"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.start_jvm()

    def start_jvm(self):
        self.frames = queue.Queue()
        # Its own session: the interrupt Jupyter sends this kernel's process group
        # must not reach the JVM (it would exit); the kernel turns it into a stop.
        self.jvm = subprocess.Popen(JVM, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self.read_frames, args=(self.jvm.stdout, self.frames), daemon=True).start()

    @staticmethod
    def read_frames(out, frames):
        while True:
            header = out.readline()
            if not header:
                frames.put((None, b""))
                return
            kind, length = header.decode().split()
            frames.put((kind, out.read(int(length))))

    def send(self, kind, text):
        data = text.encode()
        self.jvm.stdin.write(f"{kind} {len(data)}\n".encode() + data)
        self.jvm.stdin.flush()

    def next_frame(self):
        """The JVM's next frame; a Ctrl-C (Jupyter's interrupt) while waiting stops the cell."""
        while True:
            try:
                return self.frames.get(timeout=0.5)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                self.send("stop", "")

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False):
        if not store_history and not silent:
            # The base class counted it; a cell kept out of history is not counted.
            self.execution_count -= 1
        if not code.strip():
            return self.ok()
        if self.jvm.poll() is not None:
            # The cell before ended the JVM (System.exit): a new one, state gone.
            self.start_jvm()
        self.send("eval", code)
        decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in ("out", "err")}
        error = None
        while True:
            kind, data = self.next_frame()
            if kind in decoders:
                text = decoders[kind].decode(data)
                if text and not silent:
                    name = "stdout" if kind == "out" else "stderr"
                    self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})
            elif kind == "value" and not silent:
                content = {"execution_count": self.execution_count, "data": {"text/plain": data.decode()}, "metadata": {}}
                self.send_response(self.iopub_socket, "execute_result", content)
            elif kind == "error":
                ename, evalue, traceback = (data.decode().split("\n", 2) + ["", ""])[:3]
                error = {"ename": ename, "evalue": evalue, "traceback": traceback.rstrip("\n").split("\n")}
                self.send_response(self.iopub_socket, "error", error)
            elif kind == "done":
                break
            elif kind is None:
                error = {"ename": "KernelDied", "evalue": f"the JVM exited with {self.jvm.wait()}", "traceback": []}
                self.send_response(self.iopub_socket, "error", error)
                break
        if error:
            return {"status": "error", "execution_count": self.execution_count, **error}
        return self.ok()

    def ok(self):
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def do_shutdown(self, restart):
        self.jvm.kill()
        self.jvm.wait()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=JavaKernel)
