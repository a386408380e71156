//! The reduction kernels, as CUDA C source generated from a table.
//!
//! One kernel per (datatype, operator): `dst[i] = a[i] (op) b[i]` over `n`
//! elements (grid-stride loop; `dst` may be `a` or `b`), and one per datatype
//! for the Avg finish, `d[i] = d[i] / divisor`. The semantics are those of
//! the host loops in `braid_core::reduce`: integer Sum and Prod wrap (computed
//! on the unsigned type of the same width), floats use `fminf`/`fmaxf` (a NaN
//! operand is ignored), `f16`/`bf16` are widened to `f32`, combined, and
//! rounded back to nearest even, integer division truncates toward zero.
//!
//! The source includes no header (NVRTC needs none): `f16` converts with the
//! PTX `cvt` instructions, `bf16` with bit operations. It is compiled once per
//! process at run time by NVRTC for the device's architecture
//! ([`crate::driver::Kernels`]); this module is pure and tested on the host.

use braid_core::{DataType, RedOp};

/// Threads per block of every kernel.
pub const BLOCK_THREADS: u32 = 256;
/// At most this many blocks (the loops stride over the rest).
pub const MAX_BLOCKS: u32 = 4096;

/// The C type a datatype is stored as, and the type it is computed in.
fn c_types(dt: DataType) -> (&'static str, &'static str) {
    match dt {
        DataType::I8 => ("signed char", "int"),
        DataType::U8 => ("unsigned char", "unsigned int"),
        DataType::I32 => ("int", "int"),
        DataType::U32 => ("unsigned int", "unsigned int"),
        DataType::I64 => ("long long", "long long"),
        DataType::U64 => ("unsigned long long", "unsigned long long"),
        DataType::F16 | DataType::Bf16 => ("unsigned short", "float"),
        DataType::F32 => ("float", "float"),
        DataType::F64 => ("double", "double"),
    }
}

/// Name of the kernel computing `dst = a (op) b` for `dt`. Avg reduces as Sum.
pub fn reduce_name(dt: DataType, op: RedOp) -> String {
    format!("braid_reduce_{}_{}", short(dt), op.pairwise().name())
}

/// Name of the kernel dividing by the number of ranks (Avg) for `dt`.
pub fn divide_name(dt: DataType) -> String {
    format!("braid_divide_{}", short(dt))
}

fn short(dt: DataType) -> &'static str {
    match dt {
        DataType::I8 => "i8",
        DataType::U8 => "u8",
        DataType::I32 => "i32",
        DataType::U32 => "u32",
        DataType::I64 => "i64",
        DataType::U64 => "u64",
        DataType::F16 => "f16",
        DataType::Bf16 => "bf16",
        DataType::F32 => "f32",
        DataType::F64 => "f64",
    }
}

/// Every kernel name the module defines.
pub fn all_names() -> Vec<String> {
    let mut v = Vec::new();
    for dt in DataType::ALL {
        for op in [RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max] {
            v.push(reduce_name(dt, op));
        }
        v.push(divide_name(dt));
    }
    v
}

const PRELUDE: &str = r#"// braid reduction kernels (generated; see crates/cuda/src/kernels.rs)
__device__ __forceinline__ float braid_h2f(unsigned short h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short braid_f2h(float f) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float braid_b2f(unsigned short b) {
    unsigned int x = ((unsigned int)b) << 16;
    if ((b & 0x7fffu) > 0x7f80u) { x |= 0x00400000u; }
    return __int_as_float((int)x);
}
__device__ __forceinline__ unsigned short braid_f2b(float f) {
    unsigned int x = (unsigned int)__float_as_int(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) { return (unsigned short)((x >> 16) | 0x0040u); }
    unsigned int rounded = x + 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(rounded >> 16);
}
"#;

/// The expression combining `x` and `y` (of the compute type) for `op`.
fn combine(dt: DataType, op: RedOp) -> String {
    let wrap = |sym: &str| -> String {
        // Signed Sum/Prod wrap: compute on the unsigned type of the width.
        match dt {
            DataType::I8 | DataType::I32 => {
                format!("(int)((unsigned int)x {sym} (unsigned int)y)")
            }
            DataType::I64 => {
                format!("(long long)((unsigned long long)x {sym} (unsigned long long)y)")
            }
            _ => format!("x {sym} y"),
        }
    };
    match op.pairwise() {
        RedOp::Sum => wrap("+"),
        RedOp::Prod => wrap("*"),
        RedOp::Min | RedOp::Max => {
            let min = op.pairwise() == RedOp::Min;
            match dt {
                DataType::F16 | DataType::Bf16 | DataType::F32 => {
                    (if min { "fminf(x, y)" } else { "fmaxf(x, y)" }).to_string()
                }
                DataType::F64 => (if min { "fmin(x, y)" } else { "fmax(x, y)" }).to_string(),
                _ => (if min {
                    "(y < x ? y : x)"
                } else {
                    "(y > x ? y : x)"
                })
                .to_string(),
            }
        }
        RedOp::Avg => unreachable!("pairwise() never returns Avg"),
    }
}

/// Load and store wrappers for the storage type.
fn load_store(dt: DataType) -> (&'static str, &'static str) {
    match dt {
        DataType::F16 => ("braid_h2f", "braid_f2h"),
        DataType::Bf16 => ("braid_b2f", "braid_f2b"),
        _ => ("", ""),
    }
}

/// The complete CUDA C source of every kernel.
pub fn source() -> String {
    let mut s = String::from(PRELUDE);
    for dt in DataType::ALL {
        let (st, ct) = c_types(dt);
        let (ld, stf) = load_store(dt);
        for op in [RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max] {
            s.push_str(&format!(
                "extern \"C\" __global__ void {name}({st}* dst, const {st}* a, const {st}* b, unsigned long long n) {{\n\
                 \x20   for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;\n\
                 \x20        i += (unsigned long long)gridDim.x * blockDim.x) {{\n\
                 \x20       {ct} x = ({ct}){ld}(a[i]);\n\
                 \x20       {ct} y = ({ct}){ld}(b[i]);\n\
                 \x20       dst[i] = ({st}){stf}({expr});\n\
                 \x20   }}\n\
                 }}\n",
                name = reduce_name(dt, op),
                expr = combine(dt, op),
            ));
        }
        let div = if dt.is_float() {
            format!("x / ({ct})divisor")
        } else {
            format!("({ct})(x / ({ct})divisor)")
        };
        s.push_str(&format!(
            "extern \"C\" __global__ void {name}({st}* d, unsigned long long n, unsigned int divisor) {{\n\
             \x20   for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;\n\
             \x20        i += (unsigned long long)gridDim.x * blockDim.x) {{\n\
             \x20       {ct} x = ({ct}){ld}(d[i]);\n\
             \x20       d[i] = ({st}){stf}({div});\n\
             \x20   }}\n\
             }}\n",
            name = divide_name(dt),
        ));
    }
    s
}

/// Grid size for `n` elements (at least one block; the loops stride).
pub fn grid_for(n: usize) -> u32 {
    let blocks = n.div_ceil(BLOCK_THREADS as usize).max(1);
    blocks.min(MAX_BLOCKS as usize) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_once_and_named_uniquely() {
        let src = source();
        let names = all_names();
        assert_eq!(names.len(), DataType::ALL.len() * 5);
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "duplicate kernel names");
        for n in &names {
            let decl = format!("__global__ void {n}(");
            assert_eq!(
                src.matches(&decl).count(),
                1,
                "{n} defined {} times",
                src.matches(&decl).count()
            );
        }
        // Avg shares the Sum kernel.
        for dt in DataType::ALL {
            assert_eq!(reduce_name(dt, RedOp::Avg), reduce_name(dt, RedOp::Sum));
        }
    }

    #[test]
    fn kernels_use_the_right_types_and_semantics() {
        let src = source();
        let body = |name: &str| -> String {
            let start = src.find(&format!("void {name}(")).expect(name);
            let end = src[start..].find("\n}\n").unwrap() + start;
            src[start..end].to_string()
        };
        // Signed integer sums wrap through unsigned arithmetic.
        assert!(body("braid_reduce_i32_sum").contains("(unsigned int)x + (unsigned int)y"));
        assert!(
            body("braid_reduce_i64_prod").contains("(unsigned long long)x * (unsigned long long)y")
        );
        // Half types are widened and rounded back.
        let h = body("braid_reduce_f16_max");
        assert!(
            h.contains("unsigned short* dst")
                && h.contains("braid_h2f(a[i])")
                && h.contains("braid_f2h(fmaxf(x, y))"),
            "{h}"
        );
        let b = body("braid_reduce_bf16_min");
        assert!(
            b.contains("braid_b2f(b[i])") && b.contains("braid_f2b(fminf(x, y))"),
            "{b}"
        );
        assert!(body("braid_reduce_f64_min").contains("fmin(x, y)"));
        assert!(body("braid_reduce_u8_max").contains("(y > x ? y : x)"));
        // Division: integers truncate in the compute type, floats divide.
        assert!(body("braid_divide_i8").contains("(int)(x / (int)divisor)"));
        assert!(body("braid_divide_f32").contains("x / (float)divisor"));
        // No header is needed.
        assert!(!src.contains("#include"));
        // Balanced braces (a cheap syntax check).
        assert_eq!(src.matches('{').count(), src.matches('}').count());
    }

    #[test]
    fn grid_is_bounded_and_never_empty() {
        assert_eq!(grid_for(0), 1);
        assert_eq!(grid_for(1), 1);
        assert_eq!(grid_for(256), 1);
        assert_eq!(grid_for(257), 2);
        assert_eq!(grid_for(usize::MAX / 2), MAX_BLOCKS);
    }
}
