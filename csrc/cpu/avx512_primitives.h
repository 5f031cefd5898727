// The AVX-512 (F, BW, DQ and VL) primitives of the chunk kernels, shared by the avx512 and
// avx512_gfni kernels. Included inside an instruction-set namespace, under a target pragma that
// enables at least these instructions, after <immintrin.h> and <cstring>; it includes nothing.

constexpr int64_t kVectorBytes = 64;

inline void half_to_float(const torch::headeronly::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(0xffff, bits));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i].x);
}

typedef float Float16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));
typedef double Double8 __attribute__((vector_size(64)));
typedef int64_t Long8 __attribute__((vector_size(64)));

// The masked forms throughout: GCC 12's unmasked ones start from an undefined vector and warn.
inline void gather(const float* table, const Int16& index, Float16& out) {
  out = reinterpret_cast<Float16>(_mm512_mask_i32gather_ps(
      _mm512_setzero_ps(), 0xffff, reinterpret_cast<__m512i>(index), table, 4));
}
inline void gather(const double* table, const Long8& index, Double8& out) {
  out = reinterpret_cast<Double8>(_mm512_mask_i64gather_pd(
      _mm512_setzero_pd(), 0xff, reinterpret_cast<__m512i>(index), table, 8));
}

// Each lane rounded down to a whole number, as an index: the conversion rounds down itself.
constexpr int kFloor = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
inline void floor_to_index(const Float16& v, Int16& out) {
  out = reinterpret_cast<Int16>(
      _mm512_maskz_cvt_roundps_epi32(0xffff, reinterpret_cast<__m512>(v), kFloor));
}
inline void floor_to_index(const Double8& v, Long8& out) {
  out = reinterpret_cast<Long8>(
      _mm512_maskz_cvt_roundpd_epi64(0xff, reinterpret_cast<__m512d>(v), kFloor));
}

// floor(v * scale - origin) as an index (NaN, or beyond the index range: outside [0, 256)). The
// fused multiply-subtract rounds down, which keeps the floor of the exact result.
inline void shifted_floor(const Float16& v, const Float16& scale, const Float16& origin,
                          Int16& out) {
  const __m512 shifted =
      _mm512_fmsub_round_ps(reinterpret_cast<__m512>(v), reinterpret_cast<__m512>(scale),
                            reinterpret_cast<__m512>(origin), kFloor);
  out = reinterpret_cast<Int16>(_mm512_maskz_cvt_roundps_epi32(0xffff, shifted, kFloor));
}
inline void shifted_floor(const Double8& v, const Double8& scale, const Double8& origin,
                          Long8& out) {
  const __m512d shifted =
      _mm512_fmsub_round_pd(reinterpret_cast<__m512d>(v), reinterpret_cast<__m512d>(scale),
                            reinterpret_cast<__m512d>(origin), kFloor);
  out = reinterpret_cast<Long8>(_mm512_maskz_cvt_roundpd_epi64(0xff, shifted, kFloor));
}

inline bool any_lane(const Int16& mask) {
  const __m512i m = reinterpret_cast<__m512i>(mask);
  return _mm512_test_epi32_mask(m, m) != 0;
}
inline bool any_lane(const Long8& mask) {
  const __m512i m = reinterpret_cast<__m512i>(mask);
  return _mm512_test_epi64_mask(m, m) != 0;
}

// Stores the lanes of index selected by mask contiguously at out (a whole vector is written);
// returns how many there were.
inline int64_t pack_lanes(const Int16& index, const Int16& mask, int32_t* out) {
  const __m512i m = reinterpret_cast<__m512i>(mask);
  const __mmask16 keep = _mm512_test_epi32_mask(m, m);
  _mm512_storeu_si512(out, _mm512_maskz_compress_epi32(keep, reinterpret_cast<__m512i>(index)));
  return __builtin_popcount(keep);
}
inline int64_t pack_lanes(const Long8& index, const Long8& mask, int64_t* out) {
  const __m512i m = reinterpret_cast<__m512i>(mask);
  const __mmask8 keep = _mm512_test_epi64_mask(m, m);
  _mm512_storeu_si512(out, _mm512_maskz_compress_epi64(keep, reinterpret_cast<__m512i>(index)));
  return __builtin_popcount(keep);
}

// Four vectors of bin codes as bytes, in any order (counting needs none): signed saturation keeps
// every code outside [0, bins] outside it, and -1 (in no bin) as 0xff.
template <typename Bytes>
inline void narrow_codes(const Int16 (&codes)[4], Bytes& out) {
  static_assert(sizeof(Bytes) == 64);
  const __m512i low =
      _mm512_packs_epi32(reinterpret_cast<__m512i>(codes[0]), reinterpret_cast<__m512i>(codes[1]));
  const __m512i high =
      _mm512_packs_epi32(reinterpret_cast<__m512i>(codes[2]), reinterpret_cast<__m512i>(codes[3]));
  out = reinterpret_cast<Bytes>(_mm512_packs_epi16(low, high));
}
template <typename Bytes>
inline void narrow_codes(const Long8 (&codes)[4], Bytes& out) {
  static_assert(sizeof(Bytes) == 32);
  __m128i part[4];
  for (int q = 0; q < 4; ++q) {
    part[q] = _mm512_maskz_cvtsepi64_epi8(0xff, reinterpret_cast<__m512i>(codes[q]));
  }
  out = reinterpret_cast<Bytes>(
      _mm256_set_m128i(_mm_unpacklo_epi64(part[2], part[3]), _mm_unpacklo_epi64(part[0], part[1])));
}

// Adds one to each lane of counts where v <= limit: a compare into a mask and a masked subtract of
// -1 (the generic form materialises the comparison first).
inline void count_at_most(const Float16& v, const Float16& limit, Int16& counts) {
  const __mmask16 at_most =
      _mm512_cmp_ps_mask(reinterpret_cast<__m512>(v), reinterpret_cast<__m512>(limit), _CMP_LE_OQ);
  const __m512i c = reinterpret_cast<__m512i>(counts);
  counts = reinterpret_cast<Int16>(_mm512_mask_sub_epi32(c, at_most, c, _mm512_set1_epi32(-1)));
}
inline void count_at_most(const Double8& v, const Double8& limit, Long8& counts) {
  const __mmask8 at_most = _mm512_cmp_pd_mask(reinterpret_cast<__m512d>(v),
                                              reinterpret_cast<__m512d>(limit), _CMP_LE_OQ);
  const __m512i c = reinterpret_cast<__m512i>(counts);
  counts = reinterpret_cast<Long8>(_mm512_mask_sub_epi64(c, at_most, c, _mm512_set1_epi64(-1)));
}

typedef uint8_t Bytes64 __attribute__((vector_size(64)));
// The sums of each eight bytes.
inline Long8 byte_sums(const Bytes64& bytes) {
  return reinterpret_cast<Long8>(
      _mm512_sad_epu8(reinterpret_cast<__m512i>(bytes), _mm512_setzero_si512()));
}

// Adds one to each byte of hits where codes equals key: a compare into a mask and a masked add.
inline void count_equal(const Bytes64& codes, const Bytes64& key, Bytes64& hits) {
  const __mmask64 equal =
      _mm512_cmpeq_epi8_mask(reinterpret_cast<__m512i>(codes), reinterpret_cast<__m512i>(key));
  hits = reinterpret_cast<Bytes64>(_mm512_mask_add_epi8(reinterpret_cast<__m512i>(hits), equal,
                                                        reinterpret_cast<__m512i>(hits),
                                                        _mm512_set1_epi8(1)));
}

// Byte lookups in a 16-entry table per 16-byte lane. The index of a code `offset` above the
// table's first entry (wrapped below it) has bit 7 clear, and the offset in its low bits, only for
// an offset below 16: then the lookup gives the entry, else 0.
inline void lookup_index(const Bytes64& offset, Bytes64& index) {
  index = reinterpret_cast<Bytes64>(
      _mm512_adds_epu8(reinterpret_cast<__m512i>(offset), _mm512_set1_epi8(0x70)));
}
inline void lookup(const Bytes64& table, const Bytes64& index, Bytes64& out) {
  out = reinterpret_cast<Bytes64>(
      _mm512_shuffle_epi8(reinterpret_cast<__m512i>(table), reinterpret_cast<__m512i>(index)));
}
