//! Reading a safetensors file that may be hostile: the header is read and checked before any
//! tensor data (the path is a regular file, the header's length is sane, every tensor's name is
//! printable and its offsets hold exactly its shape and dtype, the file is as long as the header
//! says), and then only the tensors asked for are read, each at its offset. A FIFO or
//! `/dev/zero` is refused at once instead of read until memory runs out, and a 10 GB file is
//! judged by its header, not read whole (issue 27).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;

use super::weights::WeightsError;
use super::{Precision, Tensor};

/// The largest header accepted: the safetensors format's own bound (100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// An open safetensors file whose header has been checked.
pub struct TensorFile {
    /// The path as given, for messages.
    pub path: String,
    file: File,
    /// Where the data section starts (8 + the header's length).
    data_start: u64,
    tensors: BTreeMap<String, TensorInfo>,
}

impl TensorFile {
    /// Open `path` and check its header (see the module doc); no tensor data is read.
    pub fn open(path: &Path) -> Result<TensorFile, WeightsError> {
        let p = path.display().to_string();
        let io = |error| WeightsError::Io {
            path: p.clone(),
            error,
        };
        let format = |reason: String| WeightsError::Format {
            path: p.clone(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(format(format!(
                "it is {}, not a regular file",
                crate::files::kind_of(&meta)
            )));
        }
        let len = meta.len();
        let mut file = File::open(path).map_err(io)?;
        if len < 8 {
            return Err(format(format!(
                "it is {len} bytes long, shorter than a safetensors header's length field"
            )));
        }
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(io)?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER {
            return Err(format(format!(
                "its header claims {n} bytes; safetensors headers are at most {MAX_HEADER}"
            )));
        }
        if n > len - 8 {
            return Err(format(format!(
                "its header claims {n} bytes, but the file has only {} after the length field",
                len - 8
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(io)?;
        let tensors = parse_header(&header).map_err(format)?;
        let data_len = tensors
            .values()
            .map(|t| t.data_offsets.1 as u64)
            .max()
            .unwrap_or(0);
        let data_start = 8 + n;
        if data_start + data_len != len {
            return Err(format(format!(
                "its header describes {data_len} bytes of tensor data, but the file holds {} (truncated, padded or not a safetensors file)",
                len - data_start
            )));
        }
        Ok(TensorFile {
            path: p,
            file,
            data_start,
            tensors,
        })
    }

    /// The tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor's shape, if the file has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// The file's one tensor, or the one called `name` when there are several.
    pub fn pick(&self, name: &str) -> Result<String, WeightsError> {
        match self.tensors.len() {
            1 => Ok(self.names().next().unwrap_or(name).to_string()),
            _ if self.tensors.contains_key(name) => Ok(name.to_string()),
            0 => Err(WeightsError::Format {
                path: self.path.clone(),
                reason: "it holds no tensors".into(),
            }),
            _ => Err(WeightsError::Format {
                path: self.path.clone(),
                reason: format!(
                    "expected one tensor or one named `{name}`, found {}",
                    self.names().collect::<Vec<_>>().join(", ")
                ),
            }),
        }
    }

    /// Read tensor `name` as f32, whatever floating-point type it was stored in.
    pub fn read(&mut self, name: &str) -> Result<Tensor, WeightsError> {
        let info = self.tensors.get(name).ok_or_else(|| WeightsError::Format {
            path: self.path.clone(),
            reason: format!("it has no tensor `{name}`"),
        })?;
        let (begin, end) = info.data_offsets;
        let mut bytes = vec![0u8; end - begin];
        let read = (self
            .file
            .seek(SeekFrom::Start(self.data_start + begin as u64)))
        .and_then(|_| self.file.read_exact(&mut bytes));
        read.map_err(|error| WeightsError::Io {
            path: self.path.clone(),
            error,
        })?;
        let data = to_f32(info.dtype, &bytes).ok_or_else(|| WeightsError::Dtype {
            path: self.path.clone(),
            name: name.to_string(),
            dtype: format!("{:?}", info.dtype),
        })?;
        Ok(Tensor::new(info.shape.clone(), data))
    }
}

/// Write a safetensors file tensor by tensor, stored in `precision`: the header first, from
/// the names and shapes, then each tensor's values as `values` gives them in f32, in the
/// order listed. Only one tensor is in memory at a time, so a model larger than memory can be
/// written; the file appears whole or not at all ([`crate::files::write_atomic_with`]).
pub fn write_streamed(
    path: &Path,
    precision: Precision,
    tensors: &[(String, Vec<usize>)],
    mut values: impl FnMut(&str) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<()> {
    let dtype = match precision {
        Precision::Fp32 => "F32",
        Precision::Fp16 => "F16",
        Precision::Bf16 => "BF16",
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0usize;
    for (name, shape) in tensors {
        let bytes = shape
            .iter()
            .try_fold(precision.bytes(), |n, &d| n.checked_mul(d))
            .and_then(|n| at.checked_add(n).map(|end| (n, end)))
            .ok_or_else(|| anyhow::anyhow!("tensor `{name}` {shape:?} is too large"))?;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, bytes.1]}),
        );
        at = bytes.1;
    }
    let mut text = serde_json::to_string(&header)?.into_bytes();
    // The data starts 8-byte aligned, as the safetensors library writes it.
    text.resize(text.len().next_multiple_of(8), b' ');
    crate::files::write_atomic_with(path, |w| {
        w.write_all(&(text.len() as u64).to_le_bytes())?;
        w.write_all(&text)?;
        for (name, shape) in tensors {
            let v = values(name)?;
            let n: usize = shape.iter().product();
            anyhow::ensure!(v.len() == n, "tensor `{name}`: {} values, not {n}", v.len());
            match precision {
                Precision::Fp32 => w.write_all(bytemuck::cast_slice(&v))?,
                Precision::Fp16 => {
                    let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
                    w.write_all(bytemuck::cast_slice(&h))?
                }
                Precision::Bf16 => {
                    let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    w.write_all(bytemuck::cast_slice(&h))?
                }
            }
        }
        Ok(())
    })
}

/// A header's entries, a name written twice refused: a map would keep one of the two silently
/// (serde_json's and Python's the last), and which tensor a reader then sees depends on the
/// reader.
struct Entries(serde_json::Map<String, serde_json::Value>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut map: M,
            ) -> Result<Entries, M::Error> {
                let mut entries = serde_json::Map::new();
                while let Some((name, value)) = map.next_entry::<String, serde_json::Value>()? {
                    if entries.contains_key(&name) {
                        return Err(serde::de::Error::custom(format_args!(
                            "`{}` is named twice",
                            name.escape_debug()
                        )));
                    }
                    entries.insert(name, value);
                }
                Ok(Entries(entries))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// The tensors a header describes, each checked: a printable name, a known dtype, offsets that
/// follow on from the previous tensor's and hold exactly shape × dtype bytes. The reason for a
/// refusal names the tensor.
fn parse_header(bytes: &[u8]) -> Result<BTreeMap<String, TensorInfo>, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("its header is not UTF-8 ({e})"))?;
    let Entries(entries) = serde_json::from_str(text).map_err(|e| match e.classify() {
        // A name written twice (or an array, a number): JSON, but not a header.
        serde_json::error::Category::Data => format!("its header is refused: {e}"),
        _ => format!("its header is not a JSON object ({e})"),
    })?;
    let mut tensors = BTreeMap::new();
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(format!(
                "a tensor name is empty or holds control characters ({})",
                name.escape_debug()
            ));
        }
        let info: TensorInfo = serde_json::from_value(value)
            .map_err(|e| format!("tensor `{name}` is described wrongly ({e})"))?;
        tensors.insert(name, info);
    }
    let mut by_offset: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    by_offset.sort_by_key(|(_, t)| t.data_offsets);
    let mut end = 0;
    for (name, t) in by_offset {
        let (b, e) = t.data_offsets;
        if b != end || e < b {
            return Err(format!(
                "tensor `{name}`'s data_offsets [{b}, {e}] do not follow on from the previous tensor's end ({end})"
            ));
        }
        let bits = (t.shape.iter())
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(t.dtype.bitsize()));
        match bits {
            Some(bits) if bits % 8 == 0 && bits / 8 == e - b => {}
            Some(bits) if bits % 8 == 0 => {
                return Err(format!(
                    "tensor `{name}` of shape {:?} and dtype {:?} needs {} bytes, but its data_offsets [{b}, {e}] hold {}",
                    t.shape,
                    t.dtype,
                    bits / 8,
                    e - b
                ));
            }
            _ => {
                return Err(format!(
                    "tensor `{name}`'s shape {:?} and dtype {:?} are too large: the byte count overflows",
                    t.shape, t.dtype
                ));
            }
        }
        end = e;
    }
    Ok(tensors)
}

/// Decode a tensor's little-endian bytes as f32; `None` for a type that is not floating point.
pub fn to_f32(dtype: Dtype, d: &[u8]) -> Option<Vec<f32>> {
    let v = match dtype {
        // pod_collect_to_vec copies into an aligned vector: the bytes may sit anywhere.
        Dtype::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(d),
        Dtype::F64 => bytemuck::pod_collect_to_vec::<u8, f64>(d)
            .into_iter()
            .map(|v| v as f32)
            .collect(),
        Dtype::F16 => bytemuck::pod_collect_to_vec::<u8, half::f16>(d)
            .into_iter()
            .map(half::f16::to_f32)
            .collect(),
        Dtype::BF16 => bytemuck::pod_collect_to_vec::<u8, half::bf16>(d)
            .into_iter()
            .map(half::bf16::to_f32)
            .collect(),
        _ => return None,
    };
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamed file reads back through our reader in every precision (values rounded as
    /// the precision stores them); a tensor whose values go wrong leaves no file behind.
    #[test]
    fn streamed_files_read_back_and_failures_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let list = vec![
            ("b".to_string(), vec![3]),
            ("a.weight".to_string(), vec![2, 5]),
        ];
        let values = |name: &str| {
            let n = if name == "b" { 3 } else { 10 };
            Ok((0..n).map(|i| i as f32 * 0.3 - 1.0).collect::<Vec<f32>>())
        };
        for p in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            let path = dir.path().join(format!("{}.safetensors", p.name()));
            write_streamed(&path, p, &list, values).unwrap();
            let mut f = TensorFile::open(&path).unwrap();
            for (name, shape) in &list {
                let t = f.read(name).unwrap();
                assert_eq!(&t.shape, shape);
                let want: Vec<f32> = values(name).unwrap().iter().map(|&x| p.round(x)).collect();
                assert_eq!(t.data, want, "{name} in {}", p.name());
            }
        }
        let path = dir.path().join("short.safetensors");
        let short = |name: &str| match name {
            "b" => Ok(vec![0.0; 3]),
            _ => Ok(vec![0.0; 9]),
        };
        let err = write_streamed(&path, Precision::Fp32, &list, short).unwrap_err();
        assert!(
            format!("{err:#}").contains("`a.weight`: 9 values, not 10"),
            "{err:#}"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains("short"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
