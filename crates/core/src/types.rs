//! Datatypes and reduction operators, as NCCL names them.

use std::fmt;
use std::str::FromStr;

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    I8 = 0,
    U8 = 1,
    I32 = 2,
    U32 = 3,
    I64 = 4,
    U64 = 5,
    F16 = 6,
    Bf16 = 7,
    F32 = 8,
    F64 = 9,
}

impl DataType {
    /// Every datatype, in a stable order.
    pub const ALL: [DataType; 10] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::Bf16,
        DataType::F32,
        DataType::F64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64
        )
    }

    /// The short name used by nccl-tests (`float`, `half`, `bfloat16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "half",
            DataType::Bf16 => "bfloat16",
            DataType::F32 => "float",
            DataType::F64 => "double",
        }
    }

    /// Decode from the wire byte.
    pub fn from_u8(v: u8) -> Option<DataType> {
        DataType::ALL.get(v as usize).copied()
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" | "char" => DataType::I8,
            "uint8" | "u8" => DataType::U8,
            "int32" | "i32" | "int" => DataType::I32,
            "uint32" | "u32" => DataType::U32,
            "int64" | "i64" => DataType::I64,
            "uint64" | "u64" => DataType::U64,
            "half" | "f16" | "float16" => DataType::F16,
            "bfloat16" | "bf16" => DataType::Bf16,
            "float" | "f32" | "float32" => DataType::F32,
            "double" | "f64" | "float64" => DataType::F64,
            _ => {
                return Err(format!(
                "unknown datatype '{s}': use one of int8 uint8 int32 uint32 int64 uint64 half bfloat16 float double"
            ))
            }
        })
    }
}

/// Reduction operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RedOp {
    Sum = 0,
    Prod = 1,
    Min = 2,
    Max = 3,
    /// Sum divided by the number of ranks (integer division for integer types).
    Avg = 4,
}

impl RedOp {
    /// Every operator, in a stable order.
    pub const ALL: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max, RedOp::Avg];

    /// The name used by nccl-tests.
    pub const fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Min => "min",
            RedOp::Max => "max",
            RedOp::Avg => "avg",
        }
    }

    /// The operator applied pairwise while reducing (Avg reduces as Sum and
    /// divides once at the end).
    pub const fn pairwise(self) -> RedOp {
        match self {
            RedOp::Avg => RedOp::Sum,
            o => o,
        }
    }

    /// Decode from the wire byte.
    pub fn from_u8(v: u8) -> Option<RedOp> {
        RedOp::ALL.get(v as usize).copied()
    }
}

impl fmt::Display for RedOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RedOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => RedOp::Sum,
            "prod" => RedOp::Prod,
            "min" => RedOp::Min,
            "max" => RedOp::Max,
            "avg" => RedOp::Avg,
            _ => {
                return Err(format!(
                    "unknown reduction '{s}': use one of sum prod min max avg"
                ))
            }
        })
    }
}

/// Where memory lives. Transports declare the kind of their slot memory; the
/// engine is the only layer that acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Ordinary host (CPU) memory.
    Host,
    /// Memory of the GPU with this device ordinal.
    Device(u32),
}

pub use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that braid can reduce and move: the typed API's element.
/// Sealed: implemented exactly for the plain number types of [`DataType`],
/// which have no padding and for which every bit pattern is a valid value
/// (the runtime relies on both when it views buffers as bytes).
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The matching datatype.
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl sealed::Sealed for $t {}
          impl Element for $t { const DTYPE: DataType = DataType::$d; })*
    };
}
element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
         f16 => F16, bf16 => Bf16, f32 => F32, f64 => F64);

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-call alignment check masks with `size - 1`, which equals a
    /// division's remainder only for powers of two.
    #[test]
    fn every_datatype_size_is_a_power_of_two() {
        for dt in DataType::ALL {
            assert!(dt.size().is_power_of_two(), "{dt}: {}", dt.size());
            for addr in 0..64usize {
                assert_eq!(addr & (dt.size() - 1) == 0, addr % dt.size() == 0);
            }
        }
    }
}
