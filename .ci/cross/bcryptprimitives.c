/*
 * ProcessPrng, the one export of Windows' bcryptprimitives.dll, for Debian 12's wine (8.0),
 * which lacks that DLL: Rust's standard library takes its random bytes (HashMap's keys) from
 * it since Rust 1.78, so no Rust program starts under that wine without it. setup.sh builds
 * it with mingw-w64; test.sh puts its directory on WINEPATH. The bytes come from
 * RtlGenRandom (advapi32's SystemFunction036), which wine implements.
 */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len)
{
    /* RtlGenRandom takes a 32-bit length. */
    while (len > 0) {
        ULONG chunk = len > 0x40000000 ? 0x40000000 : (ULONG)len;
        if (!SystemFunction036(data, chunk))
            return FALSE;
        data += chunk;
        len -= chunk;
    }
    return TRUE;
}
