/* The C side of the ctypes boundary: what both kernel libraries share with
 * their Python wrappers, and the table each library exports so the wrappers
 * can check it at load (tartlet/engine/kernels/abi.py).
 *
 * A struct laid out differently on the two sides, or an enum value that
 * drifted, would make C read the wrong bytes: silent memory corruption. So
 * each library exports `tq_abi()`, a table of (name, value) pairs ending
 * with a NULL name: the ABI version, the size of every struct the Python
 * side builds and the offset of each of its fields, and every enum value the
 * Python side passes. The wrapper compares it with its ctypes structures and
 * constants, entry by entry in both directions, and refuses the library
 * with the list of differences.
 *
 * Every exported symbol starts with `tq_`. */
#ifndef TQ_ABI_H
#define TQ_ABI_H

#include <stddef.h>
#include <stdint.h>

/* Raise when a change to the boundary is not visible in sizes and offsets
 * (a field's meaning or units changed). */
#define TQ_ABI_VERSION 2

/* KV pool row kinds, one enum for both libraries (tq_decoder_desc.kv_kind;
 * the cpu_kernels entry points per kind): float32 [slots, nkv, hd], int8
 * [slots, nkv, hd + 4] (kv_int8.h), IEEE binary16 [slots, nkv, hd]. */
enum { TQ_KV_F32 = 0, TQ_KV_Q8 = 1, TQ_KV_F16 = 2 };

typedef struct {
    const char *name;
    int64_t value;
} tq_abi_entry;

#define TQ_ABI_SIZE(T) {"size " #T, (int64_t)sizeof(T)}
#define TQ_ABI_FIELD(T, f) {"offset " #T "." #f, (int64_t)offsetof(T, f)}
#define TQ_ABI_ENUM(e) {"enum " #e, (int64_t)(e)}
#define TQ_ABI_END {NULL, 0}

#endif
