// hutch's Java evaluator, inside the code-interpreter guest: jshell's own engine
// (jdk.jshell, in this JVM) behind a framed pipe, driven by hutch_java_kernel.py.
// Frames both ways are "KIND LENGTH\n" then LENGTH bytes of UTF-8.
// In:  eval (a cell), stop (interrupt the running cell).
// Out: out, err (the cell's System.out/err as written), value (the last expression's
//      value), error ("name\nmessage\ntraceback"), done (the cell is over).
// The protocol owns this process's real stdout; the cell's System.out is framed into it.

import java.io.*;
import java.nio.charset.StandardCharsets;
import java.util.*;
import java.util.concurrent.*;
import java.util.stream.*;
import jdk.jshell.*;
import jdk.jshell.SourceCodeAnalysis.CompletionInfo;

public final class HutchJShell {
    private static final OutputStream PROTOCOL = new BufferedOutputStream(new FileOutputStream(FileDescriptor.out));

    static void frame(String kind, byte[] payload) {
        synchronized (PROTOCOL) {
            try {
                PROTOCOL.write((kind + " " + payload.length + "\n").getBytes(StandardCharsets.UTF_8));
                PROTOCOL.write(payload);
                PROTOCOL.flush();
            } catch (IOException e) {
                // The kernel is gone: nobody is left to tell.
                System.exit(0);
            }
        }
    }

    static void frame(String kind, String payload) {
        frame(kind, payload.getBytes(StandardCharsets.UTF_8));
    }

    /** A cell's stdout or stderr: every write becomes a frame at once, so output streams. */
    static final class Framed extends OutputStream {
        private final String kind;

        Framed(String kind) {
            this.kind = kind;
        }

        @Override
        public void write(int b) {
            frame(kind, new byte[] {(byte) b});
        }

        @Override
        public void write(byte[] b, int off, int len) {
            if (len > 0) {
                frame(kind, Arrays.copyOfRange(b, off, off + len));
            }
        }
    }

    static String readFrame(InputStream in, String[] kind) throws IOException {
        StringBuilder header = new StringBuilder();
        int c;
        while ((c = in.read()) != '\n') {
            if (c < 0) {
                return null;
            }
            header.append((char) c);
        }
        String[] parts = header.toString().split(" ");
        kind[0] = parts[0];
        byte[] payload = in.readNBytes(Integer.parseInt(parts[1]));
        return new String(payload, StandardCharsets.UTF_8);
    }

    public static void main(String[] args) throws Exception {
        // Subclasses (the empty braces): since JDK 14 a plain PrintStream's println writes
        // the text and its newline in one go, a subclass's as two writes (print, then
        // newLine), as on the JDK 11 of E2B's IJava kernel, where
        // System.out.println("Hello, World!") streams "Hello, World!" and then "\n".
        PrintStream out = new PrintStream(new Framed("out"), true, StandardCharsets.UTF_8) {};
        PrintStream err = new PrintStream(new Framed("err"), true, StandardCharsets.UTF_8) {};
        System.setOut(out);
        System.setErr(err);
        // "local": snippets run in this JVM (no second JVM to start), so the cell's
        // System.setProperty and user.dir are this process's.
        JShell shell = JShell.builder().executionEngine("local").out(out).err(err).build();
        BlockingQueue<Optional<String>> cells = new LinkedBlockingQueue<>();
        Thread reader = new Thread(() -> {
            InputStream in = new BufferedInputStream(System.in);
            String[] kind = new String[1];
            try {
                String payload;
                while ((payload = readFrame(in, kind)) != null) {
                    if (kind[0].equals("stop")) {
                        shell.stop();
                    } else {
                        cells.put(Optional.of(payload));
                    }
                }
            } catch (IOException | InterruptedException | RuntimeException e) {
                // Fall through: the kernel closed the pipe.
            }
            cells.add(Optional.empty());
        });
        reader.setDaemon(true);
        reader.start();
        while (true) {
            Optional<String> cell = cells.take();
            if (cell.isEmpty()) {
                break;
            }
            try {
                run(shell, cell.get());
            } catch (RuntimeException e) {
                frame("error", e.getClass().getSimpleName() + "\n" + e.getMessage() + "\n");
            }
            out.flush();
            err.flush();
            frame("done", "");
        }
        System.exit(0);
    }

    /** Runs a cell snippet by snippet, as jshell splits it; stops at the first error. */
    static void run(JShell shell, String code) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String rest = code;
        SnippetEvent last = null;
        while (!rest.isBlank()) {
            CompletionInfo info = analysis.analyzeCompletion(rest);
            String source;
            if (info.completeness() == SourceCodeAnalysis.Completeness.EMPTY) {
                break;
            } else if (info.completeness().isComplete()) {
                source = info.source();
                rest = info.remaining();
            } else {
                // Incomplete: evaluate what there is, for the compiler's error.
                source = rest;
                rest = "";
            }
            for (SnippetEvent event : shell.eval(source)) {
                if (event.causeSnippet() != null) {
                    continue;
                }
                if (failed(shell, event)) {
                    return;
                }
                last = event;
            }
        }
        if (last != null && isExpression(last.snippet()) && last.value() != null) {
            frame("value", display(last));
        }
    }

    static boolean failed(JShell shell, SnippetEvent event) {
        if (event.status() == Snippet.Status.REJECTED) {
            String message = shell.diagnostics(event.snippet())
                .map(d -> d.getMessage(Locale.ROOT))
                .collect(Collectors.joining("\n"));
            String oneLine = message.lines().map(String::strip).collect(Collectors.joining(" "));
            frame("error", "CompilationException\n" + oneLine + "\n" + message + "\n" + event.snippet().source());
            return true;
        }
        JShellException thrown = event.exception();
        if (thrown == null) {
            return false;
        }
        String name = thrown instanceof EvalException
            ? ((EvalException) thrown).getExceptionClassName()
            : thrown.getClass().getSimpleName();
        StringWriter trace = new StringWriter();
        trace.append(name).append(": ").append(String.valueOf(thrown.getMessage())).append('\n');
        for (StackTraceElement frame : thrown.getStackTrace()) {
            trace.append("\tat ").append(frame.toString()).append('\n');
        }
        frame("error", name + "\n" + thrown.getMessage() + "\n" + trace);
        return true;
    }

    static boolean isExpression(Snippet snippet) {
        Snippet.SubKind kind = snippet.subKind();
        return kind == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND
            || kind == Snippet.SubKind.VAR_VALUE_SUBKIND
            || kind == Snippet.SubKind.OTHER_EXPRESSION_SUBKIND;
    }

    /** jshell shows a String as a literal; a notebook shows its text. */
    static String display(SnippetEvent event) {
        String value = event.value();
        boolean string = event.snippet() instanceof VarSnippet
            && ((VarSnippet) event.snippet()).typeName().equals("String");
        if (!string || value.length() < 2 || !value.startsWith("\"") || !value.endsWith("\"")) {
            return value;
        }
        StringBuilder text = new StringBuilder();
        for (int i = 1; i < value.length() - 1; i++) {
            char c = value.charAt(i);
            if (c == '\\' && i + 1 < value.length() - 1) {
                char n = value.charAt(++i);
                text.append(n == 'n' ? '\n' : n == 't' ? '\t' : n == 'r' ? '\r' : n);
            } else {
                text.append(c);
            }
        }
        return text.toString();
    }
}
