/* The body of an engine's chunked HTTP/1.1 answer, unframed one network read at a time.
 *
 * httptools calls back into Python once for every chunk of a body, and an engine that streams sends each
 * event as a chunk of its own: a read of 30 events meant 30 calls, 30 bytes objects and a join. Here a read
 * is one call that returns its payload as one bytes object. The state between reads is two integers (which
 * part of the framing comes next, how many bytes are left of it); an incomplete size or trailer line is
 * left unconsumed for the caller to hand back with the next read. What it accepts is RFC 9112 7.1 without
 * the optional whitespace around an extension's ";" and "=" (httptools refuses it too): hex sizes, chunk
 * extensions of token names and token (or empty) or quoted-string values (skipped, unread), trailer fields of a token
 * name, a colon and visible characters, spaces or tabs (skipped); anything else is ValueError. Where a read
 * ends changes nothing: a line is refused for its length whether or not its LF came in the same read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

enum { SIZE = 0, DATA = 1, DATA_END = 2, TRAILER = 3, DONE = 4 };

#define MAX_LINE 4096  /* a size line (with its extensions) or a trailer line longer than this is refused */

/* RFC 9110 5.6.2: a token's characters */
static int
is_tchar(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c != 0 && strchr("!#$%&'*+-.^_`|~", c));
}

/* The chunk extensions in line[0..n): *( ";" token [ "=" ( token / quoted-string ) ] ) */
static int
valid_extensions(const unsigned char *line, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i < n) {
        if (line[i++] != ';') return 0;
        Py_ssize_t start = i;
        while (i < n && is_tchar(line[i])) i++;
        if (i == start) return 0;
        if (i < n && line[i] == '=') {
            i++;
            if (i < n && line[i] == '"') {  /* quoted-string: qdtext and quoted-pairs up to the closing quote */
                i++;
                while (i < n && line[i] != '"') {
                    unsigned char c = line[i];
                    if (c == '\\') {
                        if (++i >= n || (line[i] < 0x20 && line[i] != '\t') || line[i] == 0x7f) return 0;
                    } else if ((c < 0x20 && c != '\t') || c == 0x7f) {
                        return 0;
                    }
                    i++;
                }
                if (i >= n) return 0;
                i++;
            } else {  /* a token, or nothing (httptools takes an empty value too) */
                while (i < n && is_tchar(line[i])) i++;
            }
        }
    }
    return 1;
}

/* A trailer field line[0..n): token ":" then visible characters, obs-text, spaces and tabs */
static int
valid_trailer(const unsigned char *line, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i < n && is_tchar(line[i])) i++;
    if (i == 0 || i >= n || line[i] != ':') return 0;
    for (i++; i < n; i++) {
        if ((line[i] < 0x20 && line[i] != '\t') || line[i] == 0x7f) return 0;
    }
    return 1;
}

static PyObject *
fail(const char *what)
{
    PyErr_SetString(PyExc_ValueError, what);
    return NULL;
}

/* dechunk(data, state, left) -> (payload, state, left, used) */
static PyObject *
dechunk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dechunk(data: bytes, state: int, left: int)");
        return NULL;
    }
    const char *data = PyBytes_AS_STRING(args[0]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    long state = PyLong_AsLong(args[1]);
    long long left = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (state < SIZE || state > DONE || left < 0) return fail("dechunk: bad state");

    PyObject *out = PyBytes_FromStringAndSize(NULL, size);  /* the payload is never longer than the read */
    if (out == NULL) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    Py_ssize_t written = 0, at = 0;

    while (at < size && state != DONE) {
        if (state == DATA) {
            Py_ssize_t take = size - at;
            if ((long long)take > left) take = (Py_ssize_t)left;
            memcpy(dst + written, data + at, (size_t)take);
            written += take;
            at += take;
            left -= take;
            if (left == 0) { state = DATA_END; left = 2; }
        } else if (state == DATA_END) {  /* the CRLF after a chunk's data; left: how much of it is still due */
            if (data[at] != (left == 2 ? '\r' : '\n')) { Py_DECREF(out); return fail("no CRLF after a chunk's data"); }
            at++;
            if (--left == 0) state = SIZE;
        } else {  /* SIZE or TRAILER: a whole line is needed */
            const char *end = memchr(data + at, '\n', (size_t)(size - at));
            if (end == NULL) {  /* (a whole line may hold MAX_LINE bytes and its CR) */
                if (size - at > MAX_LINE + 1) { Py_DECREF(out); return fail("a chunk size or trailer line is too long"); }
                break;  /* the caller keeps data[at:] for the next read */
            }
            Py_ssize_t line = end - (data + at);  /* without the LF */
            if (line == 0 || data[at + line - 1] != '\r') { Py_DECREF(out); return fail("a line not ended by CRLF"); }
            if (line - 1 > MAX_LINE) { Py_DECREF(out); return fail("a chunk size or trailer line is too long"); }
            if (state == TRAILER) {
                if (line == 1) state = DONE;  /* the empty line that ends the message */
                else if (!valid_trailer((const unsigned char *)data + at, line - 1)) {
                    Py_DECREF(out); return fail("a trailer field that is not name: value");
                }
            } else {
                long long chunk = 0;
                Py_ssize_t i = 0, digits = 0;
                for (; i < line - 1; i++) {
                    char c = data[at + i];
                    int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                          : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
                    if (v < 0) break;
                    if (++digits > 15) { Py_DECREF(out); return fail("a chunk size too large"); }
                    chunk = chunk * 16 + v;
                }
                if (digits == 0) { Py_DECREF(out); return fail("a chunk size that is not hexadecimal"); }
                if (i < line - 1 && data[at + i] != ';') { Py_DECREF(out); return fail("a chunk size that is not hexadecimal"); }
                if (!valid_extensions((const unsigned char *)data + at + i, line - 1 - i)) {
                    Py_DECREF(out); return fail("a chunk extension that is not ;name or ;name=value");
                }
                if (chunk == 0) state = TRAILER;
                else { state = DATA; left = chunk; }
            }
            at += line + 1;
        }
    }
    if (written != size && _PyBytes_Resize(&out, written) < 0) return NULL;
    return Py_BuildValue("(NlLn)", out, state, left, at);
}

static PyMethodDef methods[] = {
    {"dechunk", (PyCFunction)(void (*)(void))dechunk, METH_FASTCALL,
     "dechunk(data, state, left) -> (payload, state, left, used): one read of a chunked body unframed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "chunked", "A chunked HTTP/1.1 body unframed a read at a time.", -1, methods,
};

PyMODINIT_FUNC
PyInit_chunked(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "SIZE", SIZE) < 0 || PyModule_AddIntConstant(m, "DATA", DATA) < 0 ||
        PyModule_AddIntConstant(m, "DATA_END", DATA_END) < 0 || PyModule_AddIntConstant(m, "TRAILER", TRAILER) < 0 ||
        PyModule_AddIntConstant(m, "DONE", DONE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
