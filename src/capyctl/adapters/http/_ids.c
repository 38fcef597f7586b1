/* Request IDs (ULIDs) made in one call: 48 bits of Unix milliseconds, then 80 random bits, as 26
 * characters of Crockford's base32, most significant first (a ULID's 130 bits, the top 2 of them 0).
 *
 * The same IDs as ids.py makes in Python, where each ID takes some fifty integer and string objects:
 * on the way to the engine write of every request, and each of them costs after an idle spell. The
 * random bits come from xoshiro256** seeded from the OS (getrandom) as the module loads: IDs must
 * differ, not be secret (they are no credential). Called with the GIL held, like every function here. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>
#include <sys/random.h>

static const char CROCKFORD[] = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";
static uint64_t state[4];

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_random(void)
{
    uint64_t result = rotl(state[1] * 5, 7) * 9, t = state[1] << 17;
    state[2] ^= state[0];
    state[3] ^= state[1];
    state[1] ^= state[2];
    state[0] ^= state[3];
    state[2] ^= t;
    state[3] = rotl(state[3], 45);
    return result;
}

/* new_request_id() -> str */
static PyObject *
new_request_id(PyObject *self, PyObject *unused)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t ms = (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
    unsigned __int128 value = ((unsigned __int128)(ms & 0xFFFFFFFFFFFFull) << 80)
        | ((unsigned __int128)(next_random() & 0xFFFFull) << 64) | next_random();
    char out[26];
    for (int i = 25; i >= 0; i--) {
        out[i] = CROCKFORD[(unsigned)(value & 31u)];
        value >>= 5;
    }
    return PyUnicode_FromKindAndData(PyUnicode_1BYTE_KIND, out, 26);
}

static PyMethodDef methods[] = {
    {"new_request_id", new_request_id, METH_NOARGS, "A new ULID: 26 characters of Crockford base32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ids", "Request IDs made in one call.", -1, methods};

PyMODINIT_FUNC
PyInit__ids(void)
{
    if (getrandom(state, sizeof state, 0) != (ssize_t)sizeof state) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    if ((state[0] | state[1] | state[2] | state[3]) == 0) state[0] = 1;  /* xoshiro's one bad state */
    return PyModule_Create(&module);
}
