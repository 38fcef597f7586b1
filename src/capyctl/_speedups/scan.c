/* The scan: what the relay check needs of a read of plain SSE chunks, in one pass over its bytes.

   scan_run(body, objects, delta_keys) reads ``body`` (``data: {...}\n\n`` events, nothing else) and returns,
   when every payload is one that ``relay_check.Head`` decodes (with ``objects``, the engine objects the
   meter keeps, as its head fields beside model, choices and error, and ``delta_keys``, the keys the field
   table knows, as the fields of ``Delta``) and none is the engine's failure event, the facts
   ``StreamCheck`` works from. The names are the caller's data: the C knows no engine's vocabulary, only
   the shape of an OpenAI chunk (model, choices, error; a choice's index and delta; a delta's role and
   tool_calls; a tool call's index). The facts are a ``ScanFacts`` (``domain/streams.py``), the type the
   module takes from there when it loads (and checks the fields of), built by a call of it:

       ScanFacts(count, model, delta_keys, top_index, text_count, first_text, objects, positions)

   - count: the chunks;
   - model: the token every chunk sends as ``model`` (a JSON string with its quotes; the same bytes in
     every chunk), or None when no chunk sends one;
   - delta_keys: a bit per name of ``delta_keys`` (in its order) that some choice's delta sent, null included;
   - top_index: the highest tool-call index any delta sent, -1 when none did;
   - text_count, first_text: how many chunks carry generated text (in some choice's delta, a truthy value
     of a key other than role, or a non-empty tool_calls), and the first of them (-1 if none);
   - objects: where the payloads of the chunks that send one of ``objects`` (not null) begin and end in
     ``body``, two offsets a chunk, flat;
   - positions: when ``"model":<model>`` occurs once in each chunk, as its model field (no key below the
     head ends in "model", and each chunk writes its model field without spaces), the offset of each
     chunk's model token, as native uint32 values in one bytes object; None otherwise. Respelling the
     tokens there (``respell``) is then each chunk's first-occurrence splice of the pattern.

   respell(body, positions, old, new) writes ``body`` again with ``new`` in place of the ``old`` token at
   each of ``positions``, checking that ``old`` is there (ValueError where it is not).

   Its Python reference is ``scan_reference.py`` beside it (``scan_run`` and ``respell`` by the same names,
   worked out of msgspec's typed decode), which the tests and the fuzz (``tests/fuzz/speedups.py``) hold it
   to. It returns None for anything it is not sure of, and the caller then decodes (msgspec): so what it
   accepts must be a subset of what the reference accepts, and its facts the reference's (positions aside,
   which it may leave out where the reference gives them).
   Fields the structs do not name are skipped, as msgspec skips them, but read as strictly as the rest.
   It refuses, among others: a delta key outside ``delta_keys``, a repeated field of the structs, a field name
   with an escape, a model that is not the same plain string (no escapes) in every chunk or absent from
   all, an index that is not a plain non-negative integer of at most 18 digits, a \\u escape of a surrogate,
   a number of more than 40 characters or with an exponent of three digits or more, nesting deeper than
   64, a line feed or a carriage return anywhere inside a payload, and invalid UTF-8 (checked strictly, as
   Python's decoder does). The fixed field lists are exported (HEAD_FIELDS ...) so that a test holds them to
   the structs, and FACT_FIELDS, the order in which it passes the facts to ``ScanFacts``.

   No allocation happens and no Python code runs before the result is built; every read is bounds-checked
   against the end. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_NUMBER 40
#define MAX_INDEX_DIGITS 18

typedef struct {
    const unsigned char *p;
    const unsigned char *start;
    const unsigned char *end;
    int non_ascii;
    int nested_model;  /* an object below the head has a key "model" */
    const struct Names *names;  /* the names this scan reads by (its own copy) */
} Scan;

/* Per chunk: what its head says */
typedef struct {
    const unsigned char *model;  /* the model token (quotes included), NULL when absent */
    Py_ssize_t model_len;
    int model_tight;  /* the token follows its key and colon at once: "model":<token> */
    int text;
    int objects;
    const unsigned char *payload;  /* where its payload begins, and ends (at its blank line) */
    const unsigned char *payload_end;
} Chunk;

typedef struct {
    unsigned int delta_keys;
    long long top_index;
} Facts;

/* ---- the structs' fields, in the order relay_check declares them ---- */

typedef struct {
    const char *name;
    Py_ssize_t len;
} Field;

#define F(name) {name, sizeof(name) - 1}

/* The head's fields: the three the relay reads, then the engine objects the caller names (scan_run's
   ``objects``, at most MAX_OBJECTS). */
#define MAX_OBJECTS 16
static const Field HEAD_FIELDS[] = {F("model"), F("choices"), F("error"), {NULL, 0}};
enum {H_MODEL = 0, H_CHOICES = 1, H_ERROR = 2, H_OBJECTS = 3};

static const Field CHOICE_FIELDS[] = {F("index"), F("delta"), {NULL, 0}};
enum {C_INDEX = 0, C_DELTA = 1};

/* The delta's keys: the caller's (scan_run's ``delta_keys``, the field table's keys, at most MAX_DELTA). Two
   are read by name, as OpenAI's chunk shape has them: "role" (no text) and "tool_calls" (a list of tool
   calls); any other is text when truthy. */
#define MAX_DELTA 16

/* The names one scan reads by: the head's fields and the delta's, pointing into the caller's two tuples of
   names (``objects``, ``delta_keys``). Each call of scan_run reads by a copy of its own, and holds references
   to those tuples until it returns, so that nothing another call does meanwhile (a call made from a
   finalizer that a reference dropped here runs, or from the garbage collector that an allocation here
   starts) can change or free the names under it. */
typedef struct Names {
    Field head[H_OBJECTS + MAX_OBJECTS + 1];
    Field delta[MAX_DELTA + 1];
    int n_objects, n_delta;
    int d_role, d_tool_calls;  /* their places in delta, -1 when absent */
} Names;

/* The names of the last call, and the tuples they point into (references): a call with the same two tuples
   (the SSE parser passes the same ones at every read) copies them instead of reading the tuples again. */
static Names cached = {{F("model"), F("choices"), F("error"), {NULL, 0}}, {{NULL, 0}}, 0, 0, -1, -1};
static PyObject *cached_objects = NULL, *cached_delta = NULL;

static const Field TOOL_CALL_FIELDS[] = {F("index"), {NULL, 0}};
enum {T_INDEX = 0};

/* The type scan_run answers with: ``domain/streams.ScanFacts``, its fields in the order of FACT_FIELDS (checked
   when the module loads), built by a call of the type. */
static const Field FACT_FIELDS[] = {F("count"), F("model"), F("delta_keys"), F("top_index"), F("text_count"),
                                    F("first_text"), F("objects"), F("positions"), {NULL, 0}};
#define N_FACTS 8
static PyObject *facts_type = NULL;

/* ---- lexing ---- */

static inline void
skip_ws(Scan *s)
{
    /* JSON's whitespace less the line feed and the carriage return: a payload is one line, and a CR is for
       the SSE parser's general way to read (a line end, whatever JSON makes of it), so it is refused here, as
       the Python reference refuses it */
    while (s->p < s->end && *s->p <= ' ' && (*s->p == ' ' || *s->p == '\t')) s->p++;  /* (most bytes: one test) */
}

static inline int
at(Scan *s, unsigned char c)
{
    return s->p < s->end && *s->p == c;
}

static inline int
hex(unsigned char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The bytes a string's scan stops at: the quote, the backslash, control characters, and non-ASCII */
static unsigned char STOP[256];

static void
init_stop(void)
{
    for (int c = 0; c < 256; c++) STOP[c] = c == '"' || c == '\\' || c < 0x20 || c >= 0x80;
}

/* A string, at its opening quote. *nonempty: it holds a character; *plain: it has no escape. */
static int
scan_string(Scan *s, int *nonempty, int *plain)
{
    const unsigned char *start = ++s->p;
    const unsigned char *p = start, *end = s->end;
    int escaped = 0;
    while (1) {
        while (p < end && !STOP[*p]) p++;
        if (p >= end) return 0;
        unsigned char c = *p;
        if (c == '"') {
            *nonempty = p != start;
            *plain = !escaped;
            s->p = p + 1;
            return 1;
        }
        if (c >= 0x80) {
            s->non_ascii = 1;
            p++;
        }
        else if (c == '\\') {
            escaped = 1;
            if (end - p < 2) return 0;
            c = p[1];
            if (c == 'u') {
                if (end - p < 6) return 0;
                int a = hex(p[2]), b = hex(p[3]), d = hex(p[4]), e = hex(p[5]);
                if (a < 0 || b < 0 || d < 0 || e < 0) return 0;
                int code = (a << 12) | (b << 8) | (d << 4) | e;
                if (code >= 0xD800 && code <= 0xDFFF) return 0;  /* surrogates: msgspec's rules, not ours */
                p += 6;
            }
            else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
                p += 2;
            }
            else {
                return 0;
            }
        }
        else {
            return 0;  /* a control character */
        }
    }
}

/* A number. *truthy: its value is not zero. */
static int
scan_number(Scan *s, int *truthy)
{
    const unsigned char *start = s->p;
    int nonzero = 0;
    if (at(s, '-')) s->p++;
    if (at(s, '0')) {
        s->p++;
        if (s->p < s->end && *s->p >= '0' && *s->p <= '9') return 0;
    }
    else if (s->p < s->end && *s->p >= '1' && *s->p <= '9') {
        nonzero = 1;
        while (s->p < s->end && *s->p >= '0' && *s->p <= '9') s->p++;
    }
    else {
        return 0;
    }
    if (at(s, '.')) {
        s->p++;
        const unsigned char *digits = s->p;
        while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
            if (*s->p != '0') nonzero = 1;
            s->p++;
        }
        if (s->p == digits) return 0;
    }
    if (at(s, 'e') || at(s, 'E')) {
        s->p++;
        if (at(s, '+') || at(s, '-')) s->p++;
        const unsigned char *digits = s->p;
        while (s->p < s->end && *s->p >= '0' && *s->p <= '9') s->p++;
        if (s->p == digits || s->p - digits > 2) return 0;  /* three exponent digits may be out of range */
    }
    if (s->p - start > MAX_NUMBER) return 0;
    *truthy = nonzero;
    return 1;
}

static int
scan_literal(Scan *s, const char *word, Py_ssize_t len)
{
    if (s->end - s->p < len || memcmp(s->p, word, len) != 0) return 0;
    s->p += len;
    return 1;
}

static int scan_value(Scan *s, int depth, int *truthy);

/* At a container's opening bracket: 1 when members follow, 0 when ``close`` ends it at once (taken) */
static int
open_container(Scan *s, unsigned char close)
{
    s->p++;
    skip_ws(s);
    if (at(s, close)) {
        s->p++;
        return 0;
    }
    return 1;
}

/* After a member: 1 when another follows (the comma taken), 0 when ``close`` ends the container (taken),
   -1 for anything else */
static int
after_member(Scan *s, unsigned char close)
{
    skip_ws(s);
    if (at(s, ',')) {
        s->p++;
        skip_ws(s);
        return 1;
    }
    if (at(s, close)) {
        s->p++;
        return 0;
    }
    return -1;
}

/* An object or array of any values, at its opening bracket */
static int
scan_container(Scan *s, int depth, int *truthy)
{
    int object = *s->p == '{';
    unsigned char close = object ? '}' : ']';
    int ignored, nonempty, plain, more;
    if (depth > MAX_DEPTH) return 0;
    *truthy = open_container(s, close);
    while (*truthy) {
        if (object) {
            const unsigned char *key = s->p + 1;
            if (!at(s, '"') || !scan_string(s, &nonempty, &plain)) return 0;
            /* a key whose raw bytes end in model (an escaped quote before it included) may hold the
               bytes "model":<token> that the rename searches for */
            if (s->p - key >= 6 && memcmp(s->p - 6, "model", 5) == 0) s->nested_model = 1;
            skip_ws(s);
            if (!at(s, ':')) return 0;
            s->p++;
            skip_ws(s);
        }
        if (!scan_value(s, depth + 1, &ignored) || (more = after_member(s, close)) < 0) return 0;
        if (!more) break;
    }
    return 1;
}

static int
scan_value(Scan *s, int depth, int *truthy)
{
    int plain;
    if (s->p >= s->end) return 0;
    switch (*s->p) {
        case '"': return scan_string(s, truthy, &plain);
        case '{':
        case '[': return scan_container(s, depth, truthy);
        case 't': *truthy = 1; return scan_literal(s, "true", 4);
        case 'f': *truthy = 0; return scan_literal(s, "false", 5);
        case 'n': *truthy = 0; return scan_literal(s, "null", 4);
        default: return scan_number(s, truthy);
    }
}

/* A field name of a struct, at its opening quote: its position in ``fields``, -1 when unknown, -2 when it
   holds an escape, a control character or non-ASCII, or does not end.
   ``hint`` is tried first: engines send a struct's fields in the order relay_check declares them, so the
   field after the last one read is most often the next (hint may be the end of ``fields``). */
static int
scan_field(Scan *s, const Field *fields, int hint)
{
    const unsigned char *start = ++s->p;
    while (s->p < s->end && *s->p != '"') {
        if (*s->p == '\\' || *s->p < 0x20 || *s->p >= 0x80) return -2;
        s->p++;
    }
    if (s->p >= s->end) return -2;
    Py_ssize_t len = s->p - start;
    s->p++;
    if (fields[hint].name != NULL && fields[hint].len == len && memcmp(fields[hint].name, start, len) == 0)
        return hint;
    for (int i = 0; fields[i].name != NULL; i++) {
        if (i != hint && fields[i].len == len && memcmp(fields[i].name, start, len) == 0) return i;
    }
    /* an unknown field "model" below the head (a choice's, a tool call's) may hold the rename's pattern as a
       key inside a skipped value may (scan_container; a field name here has no escape) */
    if (len == 5 && memcmp(start, "model", 5) == 0) s->nested_model = 1;
    return -1;
}

/* A plain non-negative integer of a few digits, or null (-1) */
static int
scan_index(Scan *s, long long *value)
{
    if (at(s, 'n')) {
        *value = -1;
        return scan_literal(s, "null", 4);
    }
    const unsigned char *start = s->p;
    long long v = 0;
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
        if (s->p - start >= MAX_INDEX_DIGITS) return 0;  /* refused before the next digit could overflow v */
        v = v * 10 + (*s->p - '0');
        s->p++;
    }
    Py_ssize_t digits = s->p - start;
    if (digits == 0 || (start[0] == '0' && digits > 1)) return 0;
    if (at(s, '.') || at(s, 'e') || at(s, 'E')) return 0;  /* a float: msgspec refuses it for an int */
    *value = v;
    return 1;
}

/* A struct's object: each field read by ``field(s, index, context)``; a repeated field refused, and an
   unknown one too where ``skip`` is 0; else an unknown field's value is skipped (read as any value, as
   strictly as the rest, at nesting depth ``skip``: the typed decode does not read it either). */
typedef int (*FieldFn)(Scan *s, int index, void *context);

static int
scan_struct(Scan *s, const Field *fields, FieldFn field, void *context, int skip)
{
    unsigned int seen = 0;
    int more, hint = 0, ignored;
    if (!at(s, '{')) return 0;
    more = open_container(s, '}');
    while (more) {
        if (!at(s, '"')) return 0;
        int index = scan_field(s, fields, hint);
        if (index == -2 || (index == -1 && !skip) || (index >= 0 && (seen & (1u << index)))) return 0;
        skip_ws(s);
        if (!at(s, ':')) return 0;
        s->p++;
        skip_ws(s);
        if (index >= 0) {
            seen |= 1u << index;
            hint = index + 1;
            if (!field(s, index, context)) return 0;
        }
        else if (!scan_value(s, skip, &ignored)) {
            return 0;
        }
        if ((more = after_member(s, '}')) < 0) return 0;
    }
    return 1;
}

/* ---- the structs ---- */

typedef struct {
    Facts *facts;
    int text;
} ChoiceContext;

static int
tool_call_field(Scan *s, int index, void *context)
{
    Facts *facts = (Facts *)context;
    int ignored;
    if (index == T_INDEX) {
        long long value;
        if (!scan_index(s, &value)) return 0;
        if (value > facts->top_index) facts->top_index = value;
        return 1;
    }
    return scan_value(s, 2, &ignored);
}

/* A list of structs (or null); *nonempty: it holds one */
static int
scan_struct_list(Scan *s, const Field *fields, FieldFn field, void *context, int skip, int *nonempty)
{
    int more;
    *nonempty = 0;
    if (at(s, 'n')) return scan_literal(s, "null", 4);
    if (!at(s, '[')) return 0;
    more = *nonempty = open_container(s, ']');
    while (more) {
        if (!scan_struct(s, fields, field, context, skip) || (more = after_member(s, ']')) < 0) return 0;
    }
    return 1;
}

static int
delta_field(Scan *s, int index, void *context)
{
    ChoiceContext *choice = (ChoiceContext *)context;
    int truthy = 0;
    choice->facts->delta_keys |= 1u << index;
    if (index == s->names->d_tool_calls) {
        if (!scan_struct_list(s, TOOL_CALL_FIELDS, tool_call_field, choice->facts, 5, &truthy)) return 0;
    }
    else if (!scan_value(s, 3, &truthy)) {
        return 0;
    }
    if (truthy && index != s->names->d_role) choice->text = 1;  /* a role is no text */
    return 1;
}

static int
choice_field(Scan *s, int index, void *context)
{
    int ignored;
    if (index == C_INDEX) {
        long long value;
        return scan_index(s, &value);
    }
    if (index == C_DELTA) {
        if (at(s, 'n')) return scan_literal(s, "null", 4);
        return scan_struct(s, s->names->delta, delta_field, context, 0);
    }
    return scan_value(s, 3, &ignored);
}

typedef struct {
    Facts *facts;
    Chunk *chunk;
    int error;
    int choices;
} HeadContext;

static int
head_field(Scan *s, int index, void *context)
{
    HeadContext *head = (HeadContext *)context;
    int ignored, plain;
    switch (index) {
        case H_MODEL:
            if (!at(s, '"')) return 0;
            head->chunk->model = s->p;
            head->chunk->model_tight = s->p - s->start >= 8 && memcmp(s->p - 8, "\"model\":", 8) == 0;
            if (!scan_string(s, &ignored, &plain) || !plain) return 0;
            head->chunk->model_len = s->p - head->chunk->model;
            return 1;
        case H_CHOICES: {
            ChoiceContext choice = {head->facts, 0};
            head->choices = 1;
            if (!scan_struct_list(s, CHOICE_FIELDS, choice_field, &choice, 3, &ignored)) return 0;
            head->chunk->text = choice.text;
            return 1;
        }
        case H_ERROR:
            head->error = 1;
            return scan_value(s, 1, &ignored);
        default:  /* an engine object */
            if (!at(s, 'n')) head->chunk->objects = 1;
            return scan_value(s, 1, &ignored);
    }
}

/* ---- UTF-8, strictly (no overlong forms, no surrogates, nothing past U+10FFFF) ---- */

static int
valid_utf8(const unsigned char *p, const unsigned char *end)
{
    while (p < end) {
        unsigned char c = *p;
        if (c < 0x80) {
            p++;
            continue;
        }
        if (c < 0xC2 || c > 0xF4) return 0;
        if (c < 0xE0) {
            if (end - p < 2 || (p[1] & 0xC0) != 0x80) return 0;
            p += 2;
        }
        else if (c < 0xF0) {
            if (end - p < 3 || (p[2] & 0xC0) != 0x80) return 0;
            unsigned char lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
            if (p[1] < lo || p[1] > hi) return 0;
            p += 3;
        }
        else {
            if (end - p < 4 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
            unsigned char lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
            if (p[1] < lo || p[1] > hi) return 0;
            p += 4;
        }
    }
    return 1;
}

/* ---- the run ---- */

#define STACK_CHUNKS 256

/* The chunks of a run: on the stack, moved to the heap (its room doubled each time) past STACK_CHUNKS */
typedef struct {
    Chunk *items;
    Py_ssize_t room;
    Chunk stack[STACK_CHUNKS];
} Chunks;

/* Room for the chunk at ``count``; 0 (MemoryError set) when there is no memory for it */
static int
make_room(Chunks *chunks, Py_ssize_t count)
{
    if (count < chunks->room) return 1;
    Chunk *items = PyMem_Malloc(2 * chunks->room * sizeof(Chunk));
    if (items == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    memcpy(items, chunks->items, count * sizeof(Chunk));
    if (chunks->items != chunks->stack) PyMem_Free(chunks->items);
    chunks->items = items;
    chunks->room *= 2;
    return 1;
}

static PyObject *
scan(const unsigned char *body, Py_ssize_t size, Chunks *room, const Names *names)
{
    Scan s = {body, body, body + size, 0, 0, names};
    Facts facts = {0, -1};
    Py_ssize_t count = 0;
    if (size < 8 || memcmp(body, "data: {", 7) != 0) Py_RETURN_NONE;
    while (s.p < s.end) {
        if (s.end - s.p < 6 || memcmp(s.p, "data: ", 6) != 0) Py_RETURN_NONE;
        s.p += 6;
        const unsigned char *payload = s.p;
        skip_ws(&s);
        if (!make_room(room, count)) return NULL;
        Chunk *chunk = &room->items[count];
        chunk->model = NULL;
        chunk->model_len = 0;
        chunk->model_tight = 0;
        chunk->text = 0;
        chunk->objects = 0;
        HeadContext head = {&facts, chunk, 0, 0};
        if (!scan_struct(&s, names->head, head_field, &head, 1)) Py_RETURN_NONE;
        if (head.error && !head.choices) Py_RETURN_NONE;  /* the engine's failure event */
        skip_ws(&s);
        if (s.end - s.p < 2 || s.p[0] != '\n' || s.p[1] != '\n') Py_RETURN_NONE;
        chunk->payload = payload;
        chunk->payload_end = s.p;
        s.p += 2;
        count++;
    }
    if (count < 1) Py_RETURN_NONE;
    if (s.non_ascii && !valid_utf8(body, body + size)) Py_RETURN_NONE;

    const Chunk *chunks = room->items;
    const unsigned char *model = chunks[0].model;
    Py_ssize_t model_len = chunks[0].model_len;
    Py_ssize_t text_count = 0, first_text = -1, objects = 0;
    int spliceable = model != NULL && !s.nested_model && size <= (Py_ssize_t)UINT32_MAX;
    for (Py_ssize_t i = 0; i < count; i++) {
        spliceable = spliceable && chunks[i].model_tight;
        if ((chunks[i].model == NULL) != (model == NULL)) Py_RETURN_NONE;
        if (model != NULL && (chunks[i].model_len != model_len || memcmp(chunks[i].model, model, model_len) != 0))
            Py_RETURN_NONE;
        if (chunks[i].text) {
            if (first_text < 0) first_text = i;
            text_count++;
        }
        objects += chunks[i].objects;
    }

    /* the facts, in the order of FACT_FIELDS */
    PyObject *items[N_FACTS] = {NULL};
    PyObject *result = NULL;
    PyObject *offsets = items[6] = PyTuple_New(2 * objects);
    if (offsets == NULL) goto done;
    for (Py_ssize_t i = 0, j = 0; i < count; i++) {
        if (chunks[i].objects) {
            PyObject *start = PyLong_FromSsize_t(chunks[i].payload - body);
            if (start == NULL) goto done;
            PyTuple_SET_ITEM(offsets, j++, start);
            PyObject *end = PyLong_FromSsize_t(chunks[i].payload_end - body);
            if (end == NULL) goto done;  /* (the tuple's unset items are NULL: its dealloc skips them) */
            PyTuple_SET_ITEM(offsets, j++, end);
        }
    }
    if (model == NULL) {
        items[1] = Py_NewRef(Py_None);
    }
    else if ((items[1] = PyBytes_FromStringAndSize((const char *)model, model_len)) == NULL) {
        goto done;
    }
    if (!spliceable) {
        items[7] = Py_NewRef(Py_None);
    }
    else if ((items[7] = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint32_t))) != NULL) {
        char *out = PyBytes_AS_STRING(items[7]);
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t at = (uint32_t)(chunks[i].model - body);
            memcpy(out + i * sizeof(uint32_t), &at, sizeof(uint32_t));
        }
    }
    else {
        goto done;
    }
    if ((items[0] = PyLong_FromSsize_t(count)) == NULL ||
        (items[2] = PyLong_FromUnsignedLong(facts.delta_keys)) == NULL ||
        (items[3] = PyLong_FromLongLong(facts.top_index)) == NULL ||
        (items[4] = PyLong_FromSsize_t(text_count)) == NULL || (items[5] = PyLong_FromSsize_t(first_text)) == NULL)
        goto done;
    result = PyObject_Vectorcall(facts_type, items, N_FACTS, NULL);
done:
    for (int i = 0; i < N_FACTS; i++) Py_XDECREF(items[i]);
    return result;
}

/* The names of ``names`` (a tuple of at most ``max`` ASCII names) in ``dest`` (room for ``max`` and the end
   mark): their count, or -1 (TypeError set) for anything else. Reads the tuple only: no Python code runs. */
static int
read_names(PyObject *names, Field *dest, Py_ssize_t max, const char *what)
{
    Py_ssize_t n = PyTuple_Check(names) ? PyTuple_GET_SIZE(names) : -1;
    if (n < 0 || n > max) {
        PyErr_Format(PyExc_TypeError, "scan_run(): %s must be a tuple of at most %zd names", what, max);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        Py_ssize_t len;
        const char *text = PyUnicode_Check(name) && PyUnicode_IS_ASCII(name) ? PyUnicode_AsUTF8AndSize(name, &len) : NULL;
        if (text == NULL) {
            PyErr_Format(PyExc_TypeError, "scan_run(): each name in %s must be an ASCII str", what);
            return -1;
        }
        dest[i].name = text;
        dest[i].len = len;
    }
    dest[n].name = NULL;
    dest[n].len = 0;
    return (int)n;
}

static int
place_of(const Field *fields, const char *name)
{
    for (int i = 0; fields[i].name != NULL; i++) {
        if (fields[i].len == (Py_ssize_t)strlen(name) && memcmp(fields[i].name, name, fields[i].len) == 0) return i;
    }
    return -1;
}

/* The names a call reads by, in ``names``: copied from the cache where ``objects`` and ``delta`` are the tuples
   it holds, read from them otherwise (a refused tuple leaves the cache as it was: TypeError, 0); then the
   cache set to them. The references the cache dropped are left in ``*old_objects`` and ``*old_delta`` (or
   NULL), for the caller to drop once its scan is done: dropping one may run Python code (a finalizer), which
   may call scan_run again and set the cache anew. */
static int
set_names(PyObject *objects, PyObject *delta, Names *names, PyObject **old_objects, PyObject **old_delta)
{
    *old_objects = *old_delta = NULL;
    if (objects == cached_objects) {
        memcpy(names->head, cached.head, (H_OBJECTS + cached.n_objects + 1) * sizeof(Field));
        names->n_objects = cached.n_objects;
    }
    else {
        memcpy(names->head, HEAD_FIELDS, H_OBJECTS * sizeof(Field));
        if ((names->n_objects = read_names(objects, &names->head[H_OBJECTS], MAX_OBJECTS, "objects")) < 0) return 0;
    }
    if (delta == cached_delta) {
        memcpy(names->delta, cached.delta, (cached.n_delta + 1) * sizeof(Field));
        names->n_delta = cached.n_delta;
        names->d_role = cached.d_role;
        names->d_tool_calls = cached.d_tool_calls;
    }
    else {
        if ((names->n_delta = read_names(delta, names->delta, MAX_DELTA, "delta_keys")) < 0) return 0;
        names->d_role = place_of(names->delta, "role");
        names->d_tool_calls = place_of(names->delta, "tool_calls");
    }
    /* nothing above ran Python code; the cache takes its new references before it lets go of the old ones */
    if (objects != cached_objects) {
        memcpy(cached.head, names->head, (H_OBJECTS + names->n_objects + 1) * sizeof(Field));
        cached.n_objects = names->n_objects;
        *old_objects = cached_objects;
        cached_objects = Py_NewRef(objects);
    }
    if (delta != cached_delta) {
        memcpy(cached.delta, names->delta, (names->n_delta + 1) * sizeof(Field));
        cached.n_delta = names->n_delta;
        cached.d_role = names->d_role;
        cached.d_tool_calls = names->d_tool_calls;
        *old_delta = cached_delta;
        cached_delta = Py_NewRef(delta);
    }
    return 1;
}

static PyObject *
scan_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "scan_run(body, objects, delta_keys) takes bytes and two tuples of names");
        return NULL;
    }
    Names names;
    PyObject *old_objects, *old_delta;
    if (!set_names(args[1], args[2], &names, &old_objects, &old_delta)) return NULL;
    /* the call's own references to the names it reads by, held until it returns */
    PyObject *objects = Py_NewRef(args[1]), *delta = Py_NewRef(args[2]);
    PyObject *arg = args[0];
    const unsigned char *body = (const unsigned char *)PyBytes_AS_STRING(arg);
    Py_ssize_t size = PyBytes_GET_SIZE(arg);
    Chunks chunks;
    chunks.items = chunks.stack;
    chunks.room = STACK_CHUNKS;
    PyObject *result = scan(body, size, &chunks, &names);
    if (chunks.items != chunks.stack) PyMem_Free(chunks.items);
    Py_XDECREF(old_objects);
    Py_XDECREF(old_delta);
    Py_DECREF(objects);
    Py_DECREF(delta);
    return result;
}

static PyObject *
respell(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1]) || !PyBytes_Check(args[2]) ||
        !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "respell(body, positions, old, new) takes four bytes");
        return NULL;
    }
    const char *body = PyBytes_AS_STRING(args[0]), *at = PyBytes_AS_STRING(args[1]);
    const char *old = PyBytes_AS_STRING(args[2]), *new = PyBytes_AS_STRING(args[3]);
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]), old_len = PyBytes_GET_SIZE(args[2]);
    Py_ssize_t new_len = PyBytes_GET_SIZE(args[3]), n = PyBytes_GET_SIZE(args[1]) / (Py_ssize_t)sizeof(uint32_t);
    if (PyBytes_GET_SIZE(args[1]) % (Py_ssize_t)sizeof(uint32_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "respell(): positions is not a whole number of uint32 values");
        return NULL;
    }
    Py_ssize_t next = 0;  /* the first byte a position may take */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t p;
        memcpy(&p, at + i * sizeof(uint32_t), sizeof(uint32_t));
        if ((Py_ssize_t)p < next || old_len > size - (Py_ssize_t)p || memcmp(body + p, old, old_len) != 0) {
            PyErr_Format(PyExc_ValueError, "respell(): position %zd (%u) does not hold the old token", i, p);
            return NULL;
        }
        next = (Py_ssize_t)p + old_len;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, size + n * (new_len - old_len));
    if (result == NULL) return NULL;
    char *out = PyBytes_AS_STRING(result);
    Py_ssize_t from = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t p;
        memcpy(&p, at + i * sizeof(uint32_t), sizeof(uint32_t));
        memcpy(out, body + from, p - from);
        out += p - from;
        memcpy(out, new, new_len);
        out += new_len;
        from = (Py_ssize_t)p + old_len;
    }
    memcpy(out, body + from, size - from);
    return result;
}

static PyMethodDef methods[] = {
    {"scan_run", (PyCFunction)(void (*)(void))scan_run, METH_FASTCALL,
     "scan_run(body, objects, delta_keys) -> ScanFacts (domain/streams.py) | None"},
    {"respell", (PyCFunction)(void (*)(void))respell, METH_FASTCALL,
     "respell(body, positions, old, new) -> body with new in place of old at each position"},
    {NULL, NULL, 0, NULL},
};

/* ``fields``' names as a tuple of str */
static PyObject *
fields_tuple(const Field *fields)
{
    Py_ssize_t n = 0;
    while (fields[n].name != NULL) n++;
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyUnicode_FromStringAndSize(fields[i].name, fields[i].len);
        if (field == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, i, field);
    }
    return tuple;
}

static int
add_fields(PyObject *module, const char *name, const Field *fields)
{
    PyObject *tuple = fields_tuple(fields);
    if (tuple == NULL) return -1;
    return PyModule_AddObject(module, name, tuple) < 0 ? (Py_DECREF(tuple), -1) : 0;
}

/* ``domain/streams.ScanFacts``, held in facts_type: its positional fields (``__match_args__``) must be
   FACT_FIELDS, in that order, as scan() passes them */
static int
load_facts_type(void)
{
    PyObject *streams = PyImport_ImportModule("capyctl.domain.streams");
    if (streams == NULL) return -1;
    PyObject *type = PyObject_GetAttrString(streams, "ScanFacts");
    Py_DECREF(streams);
    if (type == NULL) return -1;
    PyObject *fields = PyType_Check(type) ? PyObject_GetAttrString((PyObject *)type, "__match_args__") : NULL;
    PyObject *expected = fields != NULL ? fields_tuple(FACT_FIELDS) : NULL;
    int same = expected != NULL ? PyObject_RichCompareBool(fields, expected, Py_EQ) : -1;
    Py_XDECREF(fields);
    Py_XDECREF(expected);
    if (same != 1) {
        if (same == 0 || !PyErr_Occurred())
            PyErr_SetString(PyExc_ImportError,
                            "capyctl._speedups.scan: domain.streams.ScanFacts is not a type whose fields are, in "
                            "order, count, model, delta_keys, top_index, text_count, first_text, objects, positions");
        Py_DECREF(type);
        return -1;
    }
    Py_XSETREF(facts_type, type);
    return 0;
}

static int
exec_module(PyObject *module)
{
    init_stop();
    if (load_facts_type() < 0) return -1;
    if (add_fields(module, "HEAD_FIELDS", HEAD_FIELDS) < 0) return -1;
    if (add_fields(module, "CHOICE_FIELDS", CHOICE_FIELDS) < 0) return -1;
    if (add_fields(module, "TOOL_CALL_FIELDS", TOOL_CALL_FIELDS) < 0) return -1;
    if (add_fields(module, "FACT_FIELDS", FACT_FIELDS) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "scan", "The run scan of the typed relay (see scan.c).", 0, methods, slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit_scan(void)
{
    return PyModuleDef_Init(&moduledef);
}
