//! A small reader and writer for NumPy `.npy` files: format versions 1.0,
//! 2.0 and 3.0, little-endian float32 (`<f4`) and float16 (`<f2`, widened to
//! f32 on read), C order only. Anything else is refused with a one-line
//! reason rather than guessed at: a Fortran-order or big-endian file read as
//! if it were C-order little-endian would silently produce wrong attention.
//!
//! Format: the magic `\x93NUMPY`, a major and minor version byte, the header
//! length (u16 LE for 1.0, u32 LE for 2.0/3.0), then a Python dict literal
//! such as `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`
//! padded with spaces and a newline, then the raw data.

use std::fmt;
use std::path::Path;

const MAGIC: &[u8] = b"\x93NUMPY";

/// Why a file is not an array we can use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyError(pub String);

impl fmt::Display for NpyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NpyError {}

fn bad<T>(msg: impl Into<String>) -> Result<T, NpyError> {
    Err(NpyError(msg.into()))
}

/// An n-dimensional float32 array in C order.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Element types we read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    F16,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 => 2,
        }
    }
}

/// A value of the header dict (the subset `.npy` headers use).
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

/// A hand-written parser for the header's Python dict literal.
struct Header<'a> {
    s: &'a [u8],
    i: usize,
}

impl Header<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: u8) -> Result<(), NpyError> {
        if self.eat(c) {
            Ok(())
        } else {
            bad(format!("corrupt header: expected `{}` at byte {}", c as char, self.i))
        }
    }
    fn string(&mut self) -> Result<String, NpyError> {
        self.ws();
        let q = match self.s.get(self.i) {
            Some(&q @ (b'\'' | b'"')) => q,
            _ => return bad(format!("corrupt header: expected a quoted string at byte {}", self.i)),
        };
        self.i += 1;
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i] != q {
            self.i += 1;
        }
        if self.i >= self.s.len() {
            return bad("corrupt header: unterminated string");
        }
        let out = String::from_utf8(self.s[start..self.i].to_vec())
            .map_err(|_| NpyError("corrupt header: a string is not valid UTF-8".into()))?;
        self.i += 1;
        Ok(out)
    }
    fn int(&mut self) -> Result<usize, NpyError> {
        self.ws();
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
            self.i += 1;
        }
        // Python 2 era writers may add an `L` suffix to long integers.
        let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
        if self.s.get(self.i) == Some(&b'L') {
            self.i += 1;
        }
        digits
            .parse()
            .map_err(|_| NpyError(format!("corrupt header: expected a dimension at byte {start}")))
    }
    fn value(&mut self) -> Result<Value, NpyError> {
        self.ws();
        match self.s.get(self.i) {
            Some(b'\'' | b'"') => Ok(Value::Str(self.string()?)),
            Some(b'(') => {
                self.i += 1;
                let mut dims = Vec::new();
                while !self.eat(b')') {
                    dims.push(self.int()?);
                    if !self.eat(b',') {
                        self.expect(b')')?;
                        break;
                    }
                }
                Ok(Value::Tuple(dims))
            }
            _ => {
                let rest = &self.s[self.i..];
                for (word, v) in [(&b"True"[..], true), (&b"False"[..], false)] {
                    if rest.starts_with(word) {
                        self.i += word.len();
                        return Ok(Value::Bool(v));
                    }
                }
                bad(format!("corrupt header: unexpected value at byte {}", self.i))
            }
        }
    }
    fn dict(&mut self) -> Result<Vec<(String, Value)>, NpyError> {
        self.expect(b'{')?;
        let mut out = Vec::new();
        while !self.eat(b'}') {
            let k = self.string()?;
            self.expect(b':')?;
            out.push((k, self.value()?));
            if !self.eat(b',') {
                self.expect(b'}')?;
                break;
            }
        }
        Ok(out)
    }
}

/// Parses the bytes of a `.npy` file.
pub fn parse(bytes: &[u8]) -> Result<Array, NpyError> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return bad("not a .npy file (the magic string \\x93NUMPY is missing)");
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (hlen, hstart) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10usize),
        2 | 3 => {
            if bytes.len() < 12 {
                return bad("corrupt header: file ends inside the header length");
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        _ => {
            return bad(format!(
                ".npy format version {major}.{minor} is not supported; expected 1.0, 2.0 or 3.0"
            ))
        }
    };
    let hend = hstart.checked_add(hlen).filter(|e| *e <= bytes.len()).ok_or_else(|| {
        NpyError(format!(
            "corrupt header: it claims {hlen} bytes but the file ends first"
        ))
    })?;
    let entries = Header {
        s: &bytes[hstart..hend],
        i: 0,
    }
    .dict()?;
    // numpy writes exactly these three keys; a header with another key, or
    // one key twice (Python keeps the last, a naive reader the first), is
    // refused rather than read one way here and another way by numpy.
    for (i, (k, _)) in entries.iter().enumerate() {
        if !["descr", "fortran_order", "shape"].contains(&k.as_str()) {
            return bad(format!(
                "corrupt header: unexpected key `{}`; expected descr, fortran_order and shape",
                k.escape_debug()
            ));
        }
        if entries[..i].iter().any(|(n, _)| n == k) {
            return bad(format!("corrupt header: key `{k}` appears twice"));
        }
    }
    let get = |k: &str| entries.iter().find(|(n, _)| n == k).map(|(_, v)| v);
    let descr = match get("descr") {
        Some(Value::Str(s)) => s.as_str(),
        Some(_) => return bad("corrupt header: `descr` is not a string (structured dtypes are not supported)"),
        None => return bad("corrupt header: no `descr`"),
    };
    let elem = match descr {
        "<f4" => Elem::F32,
        "<f2" => Elem::F16,
        ">f4" | ">f2" => {
            return bad(format!(
                "dtype {descr} is big-endian; save the array as little-endian (<f4 or <f2)"
            ))
        }
        // Escaped: the file's text goes into a one-line message.
        other => {
            return bad(format!(
                "dtype {} is not supported; expected float32 (<f4) or float16 (<f2)",
                other.escape_debug()
            ))
        }
    };
    match get("fortran_order") {
        Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => {
            return bad("the array is in Fortran order; save it in C order (np.ascontiguousarray)")
        }
        _ => return bad("corrupt header: `fortran_order` is missing or not True/False"),
    }
    let shape = match get("shape") {
        Some(Value::Tuple(s)) => s.clone(),
        _ => return bad("corrupt header: `shape` is missing or not a tuple"),
    };
    let count = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| NpyError(format!("corrupt header: shape {shape:?} is too large")))?;
    let data = &bytes[hend..];
    let want = count
        .checked_mul(elem.size())
        .ok_or_else(|| NpyError(format!("corrupt header: shape {shape:?} is too large")))?;
    if data.len() != want {
        return bad(format!(
            "shape {shape:?} of {descr} needs {want} data bytes, the file has {}",
            data.len()
        ));
    }
    let data = match elem {
        Elem::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Elem::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    };
    Ok(Array { shape, data })
}

/// Reads a `.npy` file; errors name the file.
pub fn read(path: &Path) -> Result<Array, NpyError> {
    let bytes = std::fs::read(path).map_err(|e| NpyError(format!("{}: {}", path.display(), io_reason(&e))))?;
    parse(&bytes).map_err(|e| NpyError(format!("{}: {e}", path.display())))
}

/// A short, lower-case reason for an I/O error (no OS error codes).
pub fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => {
            let s = e.to_string();
            // "Is a directory (os error 21)" -> "is a directory"
            let s = s.split(" (os error").next().unwrap_or(&s).to_string();
            s.to_lowercase()
        }
    }
}

/// The bytes of a float32 C-order `.npy` file (version 1.0 when the header
/// fits, 2.0 otherwise).
pub fn to_bytes(shape: &[usize], data: &[f32]) -> Vec<u8> {
    assert_eq!(
        shape.iter().product::<usize>(),
        data.len(),
        "npy::to_bytes: shape and data disagree"
    );
    let dims = match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
        ),
    };
    let dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // The data starts at a multiple of 64 bytes; the header ends with '\n'.
    let padded = |prefix: usize| (prefix + dict.len() + 1).div_ceil(64) * 64;
    let v1 = padded(10) - 10 <= u16::MAX as usize;
    let prefix = if v1 { 10 } else { 12 };
    let total = padded(prefix);
    let hlen = total - prefix;
    let mut out = Vec::with_capacity(total + data.len() * 4);
    out.extend_from_slice(MAGIC);
    if v1 {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(hlen as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&(hlen as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.resize(total - 1, b' ');
    out.push(b'\n');
    for x in data {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Writes a float32 `.npy` file.
pub fn write(path: &Path, shape: &[usize], data: &[f32]) -> Result<(), NpyError> {
    std::fs::write(path, to_bytes(shape, data))
        .map_err(|e| NpyError(format!("cannot write {}: {}", path.display(), io_reason(&e))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(major: u8, header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[major, 0]);
        if major == 1 {
            out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        }
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn round_trip_and_alignment() {
        for shape in [vec![3usize], vec![2, 3], vec![1, 2, 3, 4], vec![0, 4], vec![]] {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 1.0).collect();
            let b = to_bytes(&shape, &data);
            let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
            assert_eq!((10 + hlen) % 64, 0);
            assert_eq!(b[10 + hlen - 1], b'\n');
            assert_eq!(parse(&b).unwrap(), Array { shape, data });
        }
    }

    #[test]
    fn versions_and_f16() {
        let data = f32s(&[1.0, -2.5]);
        for major in [1, 2, 3] {
            let a = parse(&file(
                major,
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n",
                &data,
            ))
            .unwrap();
            assert_eq!(a.data, vec![1.0, -2.5]);
        }
        // 1.0, 0.333..., 65504 (largest f16) as float16 bits
        let h: Vec<u8> = [0x3c00u16, 0x3555, 0x7bff]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let a = parse(&file(
            1,
            "{\"descr\":\"<f2\",\"fortran_order\":False,\"shape\":(1,3)}",
            &h,
        ))
        .unwrap();
        assert_eq!(a.shape, vec![1, 3]);
        assert_eq!(a.data, vec![1.0, half::f16::from_bits(0x3555).to_f32(), 65504.0]);
    }

    #[test]
    fn refusals_name_the_problem() {
        let d = f32s(&[1.0, 2.0]);
        let cases = [
            (
                file(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", &d),
                "Fortran order",
            ),
            (
                file(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", &d),
                "big-endian",
            ),
            (
                file(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", &d),
                "dtype <f8 is not supported",
            ),
            (
                file(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", &d),
                "dtype <i4",
            ),
            (
                file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", &d),
                "needs 12 data bytes",
            ),
            (
                file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", &d),
                "needs 4 data bytes",
            ),
            (
                file(1, "{'descr': '<f4', 'fortran_order': False}", &d),
                "`shape` is missing",
            ),
            (
                file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,", &d),
                "corrupt header",
            ),
            // Found by the fuzzer: numpy keeps the last of two `shape`s,
            // this reader kept the first; (1, 2) and (2,) even agree on size.
            (
                file(
                    1,
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2), 'shape': (2,), }",
                    &d,
                ),
                "key `shape` appears twice",
            ),
            (
                file(
                    1,
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 'y'}",
                    &d,
                ),
                "unexpected key `x`",
            ),
            (file(4, "{}", &d), "version 4.0"),
            (b"PK\x03\x04 not npy".to_vec(), "not a .npy file"),
            (MAGIC.to_vec(), "not a .npy file"),
        ];
        for (bytes, want) in cases {
            let e = parse(&bytes).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
            assert!(!e.contains('\n'));
        }
        // A header length past the end of the file.
        let mut b = file(1, "{}", &[]);
        b[8] = 0xff;
        assert!(parse(&b).unwrap_err().0.contains("file ends first"));
        // A shape whose element count overflows.
        let big = file(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4294967296), }",
            &[],
        );
        assert!(parse(&big).unwrap_err().0.contains("too large"));
    }
}
